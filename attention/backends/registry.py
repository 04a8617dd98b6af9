"""Registry of MLA prefill backends: an enum of lazily imported class paths plus overrides.

Each member's value is the dotted path of its class; nothing is imported until
:meth:`MLAPrefillBackendEnum.get_class` is called. Overrides replace a
member's class (or give ``CUSTOM`` one) without touching this file::

    @register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM)
    class MyBackend(MLAPrefillBackend): ...

    register_mla_prefill_backend("FLASHINFER", "my_pkg.fast.MyFlashInfer")
    MLAPrefillBackendEnum.FLASHINFER.clear_override()
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from enum import Enum, EnumMeta
from typing import Callable

from attention.backends.base import MLAPrefillBackend

_PKG = "attention.backends"


class _BackendEnumMeta(EnumMeta):
    def __getitem__(cls, name):
        try:
            return super().__getitem__(name.upper() if isinstance(name, str) else name)
        except KeyError:
            valid = ", ".join(cls.__members__)
            raise ValueError(f"unknown MLA prefill backend {name!r}; valid: {valid}") from None


@dataclass(frozen=True)
class _Override:
    path: str
    cls: type[MLAPrefillBackend] | None = None  # set when registered by decorator


_OVERRIDES: dict[MLAPrefillBackendEnum, _Override] = {}


class MLAPrefillBackendEnum(Enum, metaclass=_BackendEnumMeta):
    """All MLA prefill backends. ``CUSTOM`` has no class until one is registered."""

    FLASH_ATTN = f"{_PKG}.flash_attn.FlashAttnPrefillBackend"
    FLASHINFER = f"{_PKG}.flashinfer.FlashInferPrefillBackend"
    TRTLLM_RAGGED = f"{_PKG}.trtllm_ragged.TrtllmRaggedPrefillBackend"
    TOKENSPEED_MLA = f"{_PKG}.tokenspeed_mla.TokenspeedMLAPrefillBackend"
    AITER_FLASH_ATTN = f"{_PKG}.aiter_flash_attn.AiterFlashAttnPrefillBackend"
    TORCH_SDPA = f"{_PKG}.torch_sdpa.TorchSDPAPrefillBackend"
    CUSTOM = None

    @classmethod
    def parse(cls, backend: MLAPrefillBackendEnum | str) -> MLAPrefillBackendEnum:
        """The member for an enum value or a case-insensitive name."""
        if isinstance(backend, cls):
            return backend
        if not isinstance(backend, str):
            raise TypeError(f"backend must be an MLAPrefillBackendEnum or its name, got {type(backend).__name__}")
        return cls[backend.strip()]

    def get_path(self) -> str:
        """Dotted class path, honouring overrides."""
        override = _OVERRIDES.get(self)
        path = override.path if override else self.value
        if not path:
            raise ValueError(
                f"MLA prefill backend {self.name} has no class: register one with "
                f"register_mla_prefill_backend(MLAPrefillBackendEnum.{self.name}, ...) before use"
            )
        return path

    def get_class(self) -> type[MLAPrefillBackend]:
        """The backend class, honouring overrides; imports it on first use.

        Raises ``ImportError`` if the module cannot be imported and
        ``ValueError`` for ``CUSTOM`` without a registration.
        """
        override = _OVERRIDES.get(self)
        if override and override.cls is not None:
            return override.cls
        path = self.get_path()
        module_name, _, attr = path.rpartition(".")
        module = importlib.import_module(module_name)
        try:
            cls = getattr(module, attr)
        except AttributeError:
            raise ImportError(f"module {module_name!r} has no class {attr!r} (backend {self.name})") from None
        _check_backend_class(cls, path)
        return cls

    def is_overridden(self) -> bool:
        return self in _OVERRIDES

    def clear_override(self) -> None:
        _OVERRIDES.pop(self, None)


def register_mla_prefill_backend(
    backend: MLAPrefillBackendEnum | str, class_path: str | None = None
) -> Callable[[type[MLAPrefillBackend]], type[MLAPrefillBackend]] | None:
    """Register or override the class of an MLA prefill backend.

    With ``class_path`` the dotted path is stored (imported lazily on use) and
    ``None`` is returned; without it a class decorator is returned.
    """
    member = MLAPrefillBackendEnum.parse(backend)
    if class_path is not None:
        module_name, _, attr = class_path.rpartition(".")
        if not module_name or not attr.isidentifier():
            raise ValueError(f"class_path must look like 'package.module.ClassName', got {class_path!r}")
        _OVERRIDES[member] = _Override(class_path)
        return None

    def decorator(cls: type[MLAPrefillBackend]) -> type[MLAPrefillBackend]:
        path = f"{cls.__module__}.{cls.__qualname__}"
        _check_backend_class(cls, path)
        _OVERRIDES[member] = _Override(path, cls)
        return cls

    return decorator


def overrides_fingerprint() -> tuple[tuple[str, str, int], ...]:
    """Hashable view of the current overrides (part of the selector's cache key)."""
    return tuple(sorted((m.name, o.path, id(o.cls)) for m, o in _OVERRIDES.items()))


def _check_backend_class(cls: object, path: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, MLAPrefillBackend)):
        raise TypeError(f"{path} is not a subclass of MLAPrefillBackend")
