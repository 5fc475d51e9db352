"""The pack hook's keep path in C++ (``OffloadConfig(native_hooks=True)``).

``pack.cpp`` decides and records, for a tensor the engine keeps, exactly what
``OffloadActivations._pack`` (``offload/_packing.py``) would; it hands every other tensor (offload
candidates, subclasses, anything unusual, packs on another thread than the
one that entered the engine, every pack an observer would see) to ``_pack``
before doing anything. The Python hook stays the
reference: ``tests/offload/test_native.py`` compares the two record by record.

Built on first use with ``torch.utils.cpp_extension.load`` (a C++ compiler and
``ninja`` are needed; about 20 s once, then cached per torch version and source
under ``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``, as
``offload_native_pack_<torch version>``).
"""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

_log = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("pack.cpp")
_NAME = "offload_native_pack"
_lock = threading.Lock()
_module: ModuleType | None = None
_failure: str | None = None


class NativeUnavailable(RuntimeError):
    """The C++ pack hook could not be built or loaded here (the message says why)."""


def load() -> ModuleType:
    """The built extension, configured; builds it on the first call. Raises ``NativeUnavailable``."""
    global _module, _failure
    with _lock:
        if _module is not None:
            return _module
        if _failure is not None:
            raise NativeUnavailable(_failure)
        try:
            _module = _build()
        except Exception as e:  # a missing compiler or ninja, a header mismatch, ...
            _failure = _reason(e)
            _log.info("offload: the native pack hook is unavailable: %s", _failure)
            raise NativeUnavailable(_failure) from e
        return _module


def _reason(e: BaseException) -> str:
    """One line: the compiler's first ``error:`` line when there is one (torch's build error carries
    ninja's whole output, which ends in ninja's own line), else the message's first line."""
    texts = [str(x) for x in (e, e.__cause__) if x is not None]
    lines = [ln.strip() for text in texts for ln in text.splitlines() if ln.strip()]
    first_error = next((ln for ln in lines if "error:" in ln and not ln.startswith("ninja")), None)
    return f"{type(e).__name__}: {first_error or (lines[0] if lines else repr(e))}"


def available() -> bool:
    """Whether ``load()`` succeeds (building the extension if needed)."""
    try:
        load()
    except NativeUnavailable:
        return False
    return True


def _build() -> ModuleType:
    from torch.utils import cpp_extension

    import torch

    # One build per torch version: torch's extension cache is keyed by Python version and
    # accelerator, not by torch version, and the module reads torch's C++ structures.
    name = f"{_NAME}_{re.sub(r'[^0-9A-Za-z]', '_', torch.__version__)}"
    _log.info("offload: building the native pack hook %s from %s (once per torch version and source)", name, _SOURCE)
    module = cpp_extension.load(
        name=name, sources=[str(_SOURCE)], extra_cflags=["-O2"], is_python_module=True, verbose=False,
    )
    module.configure(_constants())
    return module


def _constants() -> dict[str, Any]:
    import torch
    from torch import nn

    from .. import _handles, _observers, _spans, ledger, modules, policy

    return {
        "tensor_type": torch.Tensor, "parameter_type": nn.Parameter,
        "parameter": policy.PARAMETER, "buffer": policy.BUFFER,
        "excluded_region": policy.EXCLUDED_REGION, "too_small": policy.TOO_SMALL,
        "in_backward": policy.IN_BACKWARD, "after_head": policy.AFTER_HEAD,
        "kept": ledger.KEPT, "is_param": policy._is_param,
        "module_names": modules._names, "current_module_name": modules.current_module_name,
        "observer_count": _observers._observer_count, "observer_tls": _observers._tls,
        "step_type": _handles._Step,
        "byte_span": _spans.byte_span,
    }
