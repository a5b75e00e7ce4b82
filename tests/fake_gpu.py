"""A GPU that is not there, for catching what only a real one would show, on a machine without CUDA.

Tensors on the device `fakegpu:0` (torch's PrivateUse1 backend under another name) hold their values in CPU
memory but report that device, so code that branches on `device.type != "cpu"` takes its device branch and runs
for real: the values are right, and two things a real GPU would show are caught:

- **Mixing.** An op handed a tensor on the fake GPU and a CPU tensor of one or more dimensions raises
  `DeviceMix` (a 0-dim CPU tensor is a scalar, which CUDA takes too). CUDA raises on most such ops (`old_pos
  is on cpu, k_cache on cuda:0`) and for the rest (indexing a device tensor with a CPU index) copies the CPU
  tensor over in secret; both are bugs here.
- **Round trips.** Every read of a device tensor's values on the host is recorded in `FakeGPU.syncs`: `.item()`,
  `int()`/`float()`/`bool()`, `.tolist()`, `.numpy()`, `.cpu()`/`.to("cpu")`, a copy into a CPU tensor, and ops
  whose output size depends on the values (`nonzero`, `unique`, `masked_select`, boolean indexing), which make
  CUDA wait for the device too. Host-to-device copies are counted in `FakeGPU.uploads`.

Use it as a context manager (`with FakeGPU() as gpu:`); tensors are put on it the usual ways (`device=DEVICE`
in a factory, `.to(DEVICE)`). What it cannot fake: `torch.Generator(device=DEVICE)`, pinned memory, CUDA
events and streams, Triton kernels (code that calls those for `device.type == "cuda"` is not reached: the
fake device's type is "fakegpu")."""
from __future__ import annotations

import traceback

import torch
import torch.utils.backend_registration as backend_registration
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

NAME = "fakegpu"
if torch._C._get_privateuse1_backend_name() != NAME:  # once per process
    # registers a device guard for the backend, which views and indexing ask for
    backend_registration._setup_privateuseone_for_python_backend(NAME)
DEVICE = torch.device(NAME, 0)
# What torch makes on a tensor's own device below the ops (the scalar of `x[i] = 0`): made on the CPU, put here.
_LIBRARY = torch.library.Library("aten", "IMPL")
_LIBRARY.impl("empty.memory_format", lambda size, **kw: OnFakeGPU(torch.empty(size, dtype=kw.get("dtype"))),
              "PrivateUse1")
_LIBRARY.impl("empty_strided", lambda size, stride, **kw: OnFakeGPU(torch.empty_strided(size, stride,
                                                                                        dtype=kw.get("dtype"))),
              "PrivateUse1")

aten = torch.ops.aten
# Ops that read device values on the host: CUDA waits for the device to finish before they return.
_SYNC_OPS = {aten.item.default, aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default,
             aten.nonzero.default, aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
             aten.masked_select.default}
_ACTIVE: list["FakeGPU"] = []


class DeviceMix(RuntimeError):
    """An op was handed tensors on the fake GPU and on the CPU."""


def _gpu() -> "FakeGPU":
    if not _ACTIVE:
        raise RuntimeError("a fakegpu tensor was used outside `with FakeGPU()`")
    return _ACTIVE[-1]


class OnFakeGPU(torch.Tensor):
    """A tensor on the fake GPU: `elem` is its CPU twin, which holds the values."""

    elem: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl  # FakeGPU, the mode, sees the calls first

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        out = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(), dtype=elem.dtype,
                                                  device=DEVICE, storage_offset=elem.storage_offset(),
                                                  requires_grad=False)
        out.elem = elem
        return out

    def __repr__(self) -> str:
        return f"OnFakeGPU({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        gpu = _gpu()
        leaves, _ = tree_flatten((args, kwargs))
        on_host = [t for t in leaves if type(t) is torch.Tensor and t.dim() > 0]
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(dst, OnFakeGPU) and not isinstance(src, OnFakeGPU) and src.dim() > 0:
                gpu.uploads += 1
            elif not isinstance(dst, OnFakeGPU):
                gpu.record_sync("copy_ to the host")
        elif on_host:
            raise DeviceMix(f"{func}: tensors on {DEVICE} and on cpu (shapes {[tuple(t.shape) for t in on_host]})")
        if func in _SYNC_OPS:
            gpu.record_sync(str(func))
        elif func is aten.index.Tensor and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                               for i in args[1] if i is not None):
            gpu.record_sync("boolean indexing")
        if isinstance(kwargs.get("device"), torch.device) and kwargs["device"].type == NAME:
            kwargs["device"] = torch.device("cpu")
        out = func(*_unwrap(args), **_unwrap(kwargs))
        return tree_map(lambda t: OnFakeGPU(t) if type(t) is torch.Tensor else t, out)


def _unwrap(tree):
    return tree_map(lambda t: t.elem if isinstance(t, OnFakeGPU) else t, tree)


def _caller() -> str:
    """file:line of the innermost frame in the project's code (not torch's, not this module's)."""
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and not frame.filename.endswith("fake_gpu.py"):
            return f"{frame.filename.rsplit('/', 2)[-2]}/{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
    return "?"


def _is_fake(device) -> bool:
    return device is not None and torch.device(device).type == NAME


# Tensor methods that hand device values to Python without dispatching an op
_HOST_READS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__}


class FakeGPU(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []  # what read device values on the host, in order
        self.uploads = 0  # host-to-device copies

    def record_sync(self, what: str) -> None:
        self.syncs.append(f"{what} at {_caller()}")

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        this = args[0] if args else None
        if func in _HOST_READS and isinstance(this, OnFakeGPU):
            self.record_sync(f"Tensor.{func.__name__}")
            return func(this.elem, *args[1:], **kwargs)
        if func is torch.Tensor.cpu and isinstance(this, OnFakeGPU):
            self.record_sync("Tensor.cpu")
            return this.elem.clone()
        if func is torch.Tensor.to:
            return self._to(this, args[1:], kwargs)
        if _is_fake(kwargs.get("device")):  # a factory: made on the CPU, then put on the device
            kwargs["device"] = "cpu"
            if func in (torch.tensor, torch.as_tensor) and not isinstance(args[0], OnFakeGPU):
                self.uploads += 1
            out = func(*args, **kwargs)
            return tree_map(lambda t: OnFakeGPU(t) if type(t) is torch.Tensor else t, out)
        return func(*args, **kwargs)

    def _to(self, this: torch.Tensor, args, kwargs):
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        fake = isinstance(this, OnFakeGPU)
        values = this.elem if fake else this
        converted = values.to(dtype=dtype or values.dtype, copy=kwargs.get("copy", False))
        if _is_fake(device) or (device is None and fake):
            if not fake:
                self.uploads += 1
            return this if fake and converted is values else OnFakeGPU(converted)
        if fake:  # to the CPU
            self.record_sync("Tensor.to(cpu)")
            return converted.clone() if converted is values else converted
        return this.to(*args, **kwargs)
