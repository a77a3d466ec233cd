"""What every launcher shares: argument checks that name the bad argument, the FP8 format, the
one switch the CPU interpreter needs, which GPUs take inline PTX and Hopper's features, and
predicated PTX stores that keep a tile in its own layout (NVIDIA only; not for the
interpreter).

Under `TRITON_INTERPRET=1` a kernel's tensors are numpy arrays and bfloat16 is held as raw
uint16, so a bf16 `tl.dot` (or bf16 arithmetic) would compute on bit patterns. Kernels therefore
load bf16, cast dot operands to `DOT` (float32 in the interpreter, bfloat16 on the GPU, where the
cast is free; `DOT16` likewise for float16) and do all elementwise math in float32.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

INTERPRET = bool(triton.knobs.runtime.interpret)
DOT = tl.constexpr(tl.float32 if INTERPRET else tl.bfloat16)
# FP8 (e4m3) operands widen to float16 in one instruction per pair on the GPU (bfloat16 takes
# about four): kernels that multiply FP8 values use float16 operands.
DOT16 = tl.constexpr(tl.float32 if INTERPRET else tl.float16)
_SOFT_FP8 = tl.constexpr(INTERPRET)


def nvidia_ptx(device: torch.device) -> bool:
    """Kernels may carry inline PTX here: an NVIDIA GPU, not the interpreter."""
    return device.type == "cuda" and not INTERPRET and torch.version.hip is None


def hopper_or_later(device: torch.device) -> bool:
    """An NVIDIA GPU of compute capability 9.0 or later (what tiles tuned on the H200 and
    programmatic dependent launches assume); False on the CPU and under the interpreter."""
    return device.type == "cuda" and not INTERPRET and _capability_9(device.index)


@functools.lru_cache(maxsize=None)
def _capability_9(index: int | None) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9



def _interpreter_numpy_fix() -> None:
    """Triton 3.6's interpreter turns a scalar into a loop bound with `int(array)`, and its
    scalars are 1-element 1-D arrays, which numpy >= 2.4 refuses to convert: every
    data-dependent `range(start, end)` would fail. Re-point `__index__` at the element."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor
    if getattr(patch, "lockstep_fixed", False):
        return

    def fixed(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    fixed.lockstep_fixed = True
    interpreter._patch_lang_tensor = fixed


def _interpreter_patch_once() -> None:
    """Triton 3.6's interpreter re-patches triton.language (inspect.getmembers over four
    modules, ~4 ms) on every call of a @triton.jit helper from a kernel, though the kernel's
    patching is still in place; helpers called per loop step then dominate a test's time.
    Patch a language module once per kernel run (the kernel's scope restores them on exit)."""
    import inspect

    from triton.runtime import interpreter

    patch = interpreter._patch_lang
    if getattr(patch, "lockstep_fixed", False):
        return
    done: set[int] = set()  # ids of the modules patched for the running kernel
    depth = []

    def langs(fn):
        return {id(v) for v in fn.__globals__.values()
                if inspect.ismodule(v) and v in (tl, tl.core)}

    def once(fn):
        if depth and langs(fn) <= done:  # a helper of a running kernel: already patched
            return interpreter._LangPatchScope()
        scope = patch(fn)
        done.update(langs(fn))
        if depth:
            return scope  # a helper's scope is never restored (as in the interpreter)
        restore = scope.restore
        depth.append(scope)

        def restore_and_leave():
            depth.clear()
            done.clear()
            restore()

        scope.restore = restore_and_leave
        return scope

    once.lockstep_fixed = True
    interpreter._patch_lang = once


if INTERPRET:
    _interpreter_numpy_fix()
    _interpreter_patch_once()

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


def check(t, name: str, *, dims: int | None = None, dtypes: tuple = (), device=None,
          last_contiguous: bool = True) -> None:
    """Raise ValueError naming `name` when `t` is not a tensor of the given rank and dtype on
    `device` whose last dimension is unit-stride (the kernels vectorise along it)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(t.shape)}")
    if dtypes and t.dtype not in dtypes:
        want = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must be one of ({want}), got {str(t.dtype).removeprefix('torch.')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, the other arguments on {device}: move it there")
    if last_contiguous and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be unit-stride in its last dimension (strides "
                         f"{t.stride()}): pass a .contiguous() copy")


def check_cache_scale(cache: torch.Tensor, scale) -> bool:
    """Whether the paged cache is FP8; raise ValueError when its per-token scale
    [num_blocks, block_size] float32 is missing or misshapen, or given for another cache."""
    if cache.dtype != FP8:
        if scale is not None:
            raise ValueError(f"scale is only for an FP8 cache; this cache is {cache.dtype}")
        return False
    if scale is None:
        raise ValueError("an FP8 cache needs scale [num_blocks, block_size] float32")
    check(scale, "scale", dims=2, dtypes=(torch.float32,), device=cache.device, last_contiguous=False)
    check_shape(scale, "scale", tuple(cache.shape[:2]))
    return True


def check_shape(t: torch.Tensor, name: str, shape: tuple) -> None:
    """`shape` entries of None match any size."""
    if len(shape) != t.dim() or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")



def host_tensor(values, device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A list or array of host numbers on ``device`` without a host-device sync: through
    pinned memory (torch's caching host allocator keeps the block until the copy is done)
    and a non-blocking copy. A plain ``torch.tensor(values, device=...)`` copies from pageable
    memory, which waits for everything queued on the stream: inside a step that the host
    launched ahead of the GPU, that wait undoes the overlap."""
    t = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@triton.jit
def to_dtype(x, ty: tl.constexpr):
    """float32 x to ``ty``, rounded to nearest even as the GPU converts. Triton 3.6's
    interpreter truncates to bfloat16, so there the rounding is done on the bits first (NaN
    aside): a kernel whose bf16 outputs feed further math on the CPU would drift otherwise."""
    if _SOFT_FP8:
        if ty == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(ty)


@triton.jit
def to_fp8(x):
    """float32 (already within +-448) to e4m3fn, round to nearest even.

    The GPU converts in hardware. Triton 3.6's interpreter mis-rounds when rounding up carries
    into the exponent (1.97 becomes 1.0), so there the bits are assembled here."""
    if _SOFT_FP8:
        bits = x.to(tl.uint32, bitcast=True)
        sign = (bits >> 31).to(tl.int32)
        mag = bits & 0x7FFFFFFF
        # Normal range: keep exponent and 3 mantissa bits; a carry out of the mantissa moves
        # into the exponent by itself, which is exactly what rounding up should do.
        base = (mag >> 20).to(tl.int32)
        low = (mag & 0xFFFFF).to(tl.int32)
        up = (low > 0x80000) | ((low == 0x80000) & ((base & 1) == 1))
        normal = base + up.to(tl.int32) - ((127 - 7) << 3)
        # Subnormal range (below 2**-6): multiples of 2**-9; adding 2**23 rounds to even.
        a = tl.abs(x) * 512.0
        sub = ((a + 8388608.0) - 8388608.0).to(tl.int32)
        code = tl.where(mag >= 0x3C800000, normal, sub)  # 0x3C800000 is 2**-6
        code = tl.minimum(code, 0x7E)
        return ((sign << 7) | code).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    else:
        return x.to(tl.float8e4nv)


@triton.jit
def st_where(ptr, value, keep):
    """``*ptr = value`` where keep, as one predicated PTX store per element: an inline-asm
    elementwise op runs in whatever layout its operands are in (tl.store of scattered
    addresses first moves its operands to a one-element-a-thread layout, through shared
    memory)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b32 [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [ptr.to(tl.int64, bitcast=True), value, keep.to(tl.int32)], dtype=tl.int32,
        is_pure=False, pack=1)


@triton.jit
def st_where16(ptr, value, keep):
    """``st_where`` for 16-bit values (``value`` int16 bits)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b16 [$1], $2; mov.u32 $0, 0; }",
        "=r,l,h,r", [ptr.to(tl.int64, bitcast=True), value, keep.to(tl.int32)], dtype=tl.int32,
        is_pure=False, pack=1)


@triton.jit
def count_where(ptr, keep):
    """``*ptr += 1`` where keep (relaxed, device scope), one predicated PTX reduction an element."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p red.relaxed.gpu.global.add.u32 [$1], 1; mov.u32 $0, 0; }",
        "=r,l,r", [ptr.to(tl.int64, bitcast=True), keep.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
