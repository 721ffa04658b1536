"""The README and the docs pages say what is true: their commands parse with the real command
line (and the cheap ones run), CI runs the README's test command, every config key is
documented with its real default, and the README stays one screen long.

The expensive commands run elsewhere: `weightsync bench` on the tiny layout in test_bench.py,
the examples in test_examples.py / test_one_step_off.py, the floors script in test_bench.py."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import pytest
from weightsync_bench.expect import KEYS

from weightsync import SyncConfig
from weightsync.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCS = [README, *PAGES]
# pages written on parallel branches (verl, platforms, reliability); the README links them
# already. Remove an entry once its page is merged: from then on the link is checked.
PENDING_PAGES: set[str] = set()
# tests that run the scripts and examples the docs tell users to run
RUN_BY = {"examples/quickstart.py": "test_examples.py", "examples/one_step_off_cpu.py": "test_one_step_off.py",
          "benchmarks/floors.py": "test_bench.py",
          "tests/verl_e2e/run_verl.py": "verl_e2e/test_one_step_off_e2e.py",
          "tests/verl_e2e/run_fully_async.py": "verl_e2e/test_fully_async_e2e.py",
          "scripts/plot_e2e.py": "verl_e2e/test_one_step_off_e2e.py"}


def shell_blocks(path: Path) -> list[str]:
    """Fenced ```bash blocks (plain ``` blocks hold program output)."""
    return re.findall(r"^```bash\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def commands(path: Path) -> list[list[str]]:
    """Shell commands of the bash blocks, continuation lines joined, comments dropped."""
    out = []
    for block in shell_blocks(path):
        for line in block.replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue  # not shell (Python, program output)
            if words:
                out.append(words)
    return out


def weightsync_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in DOCS:
        for words in commands(path):
            if words[0] == "weightsync":
                found.append((path.name, words[1:]))
            elif words[:2] == ["bash", "scripts/bench.sh"] or words[0] == "scripts/bench.sh":
                # bench.sh passes its arguments on to `weightsync bench` after its own
                start = 2 if words[0] == "bash" else 1
                found.append((path.name, [*_bench_sh_args(), *words[start:]]))
    return found


def _bench_sh_args() -> list[str]:
    line = next(ln for ln in (ROOT / "scripts" / "bench.sh").read_text().splitlines() if ln.startswith("exec weightsync bench"))
    words = shlex.split(line)
    return [w for w in words[words.index("weightsync") + 1:] if w != "$@"]


def test_readme_fits_one_screen_of_sections():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move details to docs/"


def test_ci_runs_the_readme_test_command():
    quick = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    test_cmd = next(w for w in commands_of(quick) if "scripts/test.sh" in w)
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()
          if ln.strip() and not ln.startswith(("#", "set ", "cd "))]
    assert ci == [" ".join(test_cmd)]


def commands_of(text: str) -> list[list[str]]:
    block = re.search(r"```bash\n(.*?)```", text, flags=re.S)[1]
    return [shlex.split(ln, comments=True) for ln in block.splitlines() if shlex.split(ln, comments=True)]


def test_the_docs_show_weightsync_commands():
    # the parse test below must have something to check: the quick start, bench, doctor, reap
    shown = {args[0] for _, args in weightsync_commands()}
    assert {"bench", "doctor", "reap"} <= shown


@pytest.mark.parametrize("page, args", weightsync_commands(), ids=lambda x: x if isinstance(x, str) else " ".join(x))
def test_every_weightsync_command_in_the_docs_parses(page, args):
    parsed = build_parser().parse_args(args)  # argparse exits (SystemExit 2) on any unknown option or bad value
    assert parsed.command == args[0]


@pytest.mark.parametrize("args", sorted({tuple(a) for _, a in weightsync_commands() if a[0] == "doctor"}))
def test_every_doctor_command_in_the_docs_runs(args, capsys):
    assert main(list(args)) == 0
    assert capsys.readouterr().out.strip()


def test_every_script_the_docs_run_exists_and_a_test_runs_it():
    shown = {w for path in DOCS for words in commands(path) if words[0].startswith("python")
             for w in words[1:2] if w.endswith(".py")}
    assert shown, "no `python <script>` command found in the docs"
    for script in shown:
        assert (ROOT / script).is_file(), script
        assert script in RUN_BY, f"{script}: no test runs it (add it to RUN_BY with the test that does)"
        assert Path(script).name in (ROOT / "tests" / RUN_BY[script]).read_text(), (script, RUN_BY[script])


def _config_rows(path: Path) -> dict[str, str]:
    """key -> default of the page's configuration table (its "Configuration" section in the README)."""
    text = path.read_text()
    if path == README:
        text = text.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| ([^|]+) \|", text, flags=re.M)
    return {k: v.strip() for k, v in rows}


def _shown(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return str(value)


def test_the_configuration_table_lists_every_key_with_its_default():
    rows = _config_rows(ROOT / "docs" / "configuration.md")
    fields = {f.name: f.default for f in dataclasses.fields(SyncConfig)}
    assert {k: rows.get(k) for k in fields} == {k: _shown(v) for k, v in fields.items()}


def test_the_readme_shows_a_few_keys_each_with_its_real_default():
    rows = _config_rows(README)  # the rest is on docs/configuration.md, not repeated here
    fields = {f.name: f.default for f in dataclasses.fields(SyncConfig)}
    assert 3 <= len(rows) < len(fields) and rows == {k: _shown(fields.get(k)) for k in rows}


def test_every_verl_setting_in_the_docs_is_a_valid_config():
    prefixes = ("+weightsync.", "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.weightsync.")
    settings = {}
    for path in DOCS:
        for words in commands(path):
            for w in words:
                for prefix in prefixes:
                    if w.startswith(prefix) and "=" in w and "<" not in w:
                        key, value = w[len(prefix):].split("=", 1)
                        settings[(path.name, key)] = value
    assert any(page == "README.md" for page, _ in settings), "the README shows no verl setting"
    for (page, key), value in settings.items():
        SyncConfig.from_mapping({key: value})  # ConfigError names an unknown key or a bad value


def test_the_benchmarks_page_explains_every_expect_key():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert [k for k in KEYS if f"`{k}`" not in text] == []


def test_readme_links_point_at_files():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    local = [ln for ln in links if "://" not in ln]
    assert local
    missing = [ln for ln in local if not (ROOT / ln).exists() and ln not in PENDING_PAGES]
    assert missing == []


# -- the API reference (docs/api.md): every documented callable says what it takes, gives, raises --

def _api_callables() -> list[tuple[str, object, object]]:
    """(qualified name, callable, the object whose docstring documents its arguments) for the
    public functions and the public methods of the public classes docs/api.md renders; a class's
    constructor is documented by the class docstring (mkdocstrings renders no ``__init__``)."""
    import inspect

    import weightsync

    found = [(f.__name__, f, f) for f in (weightsync.build_manifest, weightsync.check_staleness)]
    for cls in (weightsync.Coordinator, weightsync.WeightSender, weightsync.WeightReceiver, weightsync.StagedVersion,
                weightsync.SyncConfig, weightsync.SyncResult, weightsync.Manifest, weightsync.TensorSpec):
        if "__init__" in vars(cls) and not dataclasses.is_dataclass(cls):
            found.append((f"{cls.__name__}()", cls.__init__, cls))
        for name, member in vars(cls).items():
            fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
            if not name.startswith("_") and inspect.isfunction(fn):
                found.append((f"{cls.__name__}.{name}", fn, fn))
    return found


def _sections(doc: str | None) -> dict[str, set[str]]:
    """Google-style sections of a docstring as mkdocstrings parses them: kind -> names given."""
    from griffe import Docstring, Parser

    out: dict[str, set[str]] = {}
    for section in Docstring(doc or "").parse(Parser.google, warnings=False):
        items = section.value if isinstance(section.value, list) else [section.value]
        names = {(getattr(item, "name", "") or str(getattr(item, "annotation", "") or "")).lstrip("*") for item in items}
        out.setdefault(section.kind.value, set()).update(names)
    return out


def _raised_here(fn) -> set[str]:
    """Exception classes the function's own body raises by name (not its callees, nor nested defs)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    raised, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id[:1].isupper():
                raised.add(exc.id)
        todo.extend(ast.iter_child_nodes(node))
    return raised


def test_the_api_reference_has_callables_to_check():
    checked = {name for name, _, _ in _api_callables()}
    assert {"WeightSender()", "WeightSender.stage", "WeightSender.sync", "WeightSender.close", "WeightReceiver()",
            "WeightReceiver.apply", "Coordinator.create", "SyncConfig.from_mapping", "check_staleness"} <= checked


@pytest.mark.parametrize("name, fn, owner", _api_callables(), ids=[name for name, _, _ in _api_callables()])
def test_every_api_callable_documents_args_returns_and_raises(name, fn, owner):
    import inspect

    sig = inspect.signature(fn)
    params = [p for p in sig.parameters if p not in ("self", "cls")]
    sections = _sections(inspect.getdoc(owner) if owner is not fn else fn.__doc__)
    assert (fn.__doc__ or owner.__doc__ or "").strip(), f"{name}: no docstring"
    assert sorted(sections.get("parameters", set())) == sorted(params), f"{name}: Args must name exactly {params}"
    returns = sig.return_annotation
    if owner is fn and returns not in (inspect.Signature.empty, None, "None"):
        assert "returns" in sections, f"{name} returns {returns}: no Returns section"
    missing = _raised_here(fn) - sections.get("raises", set())
    assert not missing, f"{name} raises {sorted(missing)}: not in its Raises section"
