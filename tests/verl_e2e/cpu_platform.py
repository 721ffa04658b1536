"""A CPU platform for verl 0.9.1, through verl's own hardware extension point: a
``PlatformBase`` registered in ``PlatformRegistry`` and selected with ``VERL_PLATFORM=cpu``,
loaded in every process by ``VERL_USE_EXTERNAL_MODULES`` (verl/__init__.py imports it). verl
0.9.1 ships CUDA, NPU and ROCm platforms only; on a machine without any, it falls back to CUDA
and its workers call ``torch.cuda`` (plugin/platform/platform_manager.py). This is the one
thing the end-to-end tier adds to verl: the trainer, its FSDP actor, verl's vLLM server and
the vLLM engine are the installed packages' code.

Ray placement: verl's pools ask for the platform's ``ray_resource_name`` per rank; "GPU" is
kept and the test's Ray cluster declares logical GPUs (nothing uses one), so Ray still
assigns ``CUDA_VISIBLE_DEVICES``, which verl's vLLM replicas read to place their servers.

One call cannot be reached through the platform: ``initialize_global_process_group_ray``
composes ``cpu:gloo,<device>:<backend>``, which with the device ``cpu`` names cpu twice (torch
refuses it); its default becomes plain ``gloo`` (what that string means on a host-only rank).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from verl.plugin.platform.platform_cuda import PlatformCUDA
from verl.plugin.platform.platform_manager import PlatformRegistry
from verl.utils import distributed as _distributed

_init_group = _distributed.initialize_global_process_group_ray


def initialize_global_process_group_ray(timeout_second=None, backend=None):
    return _init_group(timeout_second=timeout_second, backend=backend or "gloo")


_distributed.initialize_global_process_group_ray = initialize_global_process_group_ray


class _CpuDevice:
    """torch.cpu, with the torch.cuda calls verl makes on its device module answered as a
    host without an accelerator answers them (no cache to empty, nothing to synchronize)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(device: Any) -> None:
        pass

    @staticmethod
    def synchronize(device: Any = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def ipc_collect() -> None:
        pass

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        import psutil

        vm = psutil.virtual_memory()
        return vm.available, vm.total

    @staticmethod
    def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
        pass

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformCUDA):
    """CUDA's Ray integration (logical GPUs, CUDA_VISIBLE_DEVICES), everything else on the host."""

    _device = _CpuDevice()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> Any:
        return self._device

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return True

    def current_device(self) -> torch.device:
        # verl passes it as the device of .to() / to_empty() / FSDP's device_id: an int is cuda:N
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def is_ipc_supported(self) -> bool:
        return False

    def rollout_env_vars(self) -> dict[str, str]:
        return {}

    def get_collective_module(self) -> Any:
        return None

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def cudart(self) -> Any:
        return None
