"""docs/versions.md's table: every entry point our code registers has a row, each row names
a command whose scripts, tiers and test files exist, and no NPU row claims more than a source
check."""

from __future__ import annotations

import re
from pathlib import Path

from weightsync_vllm.plugin import TRAINER_ENGINE, WORKER_ENGINES

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "versions.md"


def rows() -> list[list[str]]:
    table = PAGE.read_text().split("| entry point | supported | what runs it | the command the tests run |", 1)[1]
    out = []
    for line in table.strip().splitlines()[1:]:
        if not line.startswith("|"):
            break
        out.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return out


def test_each_row_has_four_cells_and_a_command():
    assert len(rows()) >= 8
    for cells in rows():
        assert len(cells) == 4, cells
        assert re.search(r"`[^`]*(scripts/|pytest)[^`]*`", cells[3]), cells[3]


def test_every_script_tier_and_test_file_a_command_names_exists():
    named = 0
    for cells in rows():
        for code in re.findall(r"`([^`]+)`", cells[3]):
            for script in re.findall(r"scripts/[\w./-]+\.sh", code):
                assert (ROOT / script).is_file(), script
                named += 1
            for tier in re.findall(r"WEIGHTSYNC_TIERS=([\w-]+)", code):
                assert (ROOT / "scripts" / "tiers" / f"{tier}.sh").is_file(), tier
            for test in re.findall(r"tests/[\w/]+(?:\.py)?", code):
                assert (ROOT / test).exists(), test
    assert named >= 8


def test_every_engine_the_plugin_registers_and_every_verl_entry_point_has_a_row():
    entry_points = " ".join(cells[0] for cells in rows())
    for module, _ in [*WORKER_ENGINES.values(), TRAINER_ENGINE]:
        name = module if module != "weightsync_vllm.trainer" else "WeightTransferTrainerFactory"
        assert f"`{name}" in entry_points, name
    for module in ("weightsync_verl.one_step_off", "weightsync_verl.checkpoint_engine", "weightsync_verl.stage_ahead"):
        assert (ROOT / "integrations" / "verl" / Path(*module.split("."))).with_suffix(".py").is_file()
        assert module in entry_points, module


def test_npu_rows_say_source_checked_and_no_npu_run():
    npu = [cells for cells in rows() if "NPU" in cells[0] or "vllm-ascend" in cells[1]]
    assert len(npu) >= 2
    for cells in npu:
        assert "source-checked (conformance), no NPU run" in cells[2], cells
        assert "`bash scripts/tiers/conformance.sh`" == cells[3], cells
