"""Synchronization between the threads of one CPU step, inside numba: atomic counters and a spinning wait.

numba's CPU target has no atomics, so these are LLVM instructions emitted directly (`atomicrmw`, atomic loads,
the x86 `pause` hint). Waiting on a counter costs well under a microsecond when every thread is running, against
tens of microseconds for a fork/join of numba's `prange` (and milliseconds on a machine where the woken thread
must wait for a core). A waiter that has spun `SPINS_BEFORE_YIELD` times calls sched_yield, so on an
oversubscribed machine it hands its core to a thread it waits for instead of burning the time slice.
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

SPINS_BEFORE_YIELD = 2000
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def _slot_pointer(context, builder, arr_type, arr, index):
    ary = context.make_array(arr_type)(context, builder, arr)
    return cgutils.get_item_pointer(context, builder, arr_type, ary, [index])


@intrinsic
def atomic_add(typingctx, arr, index, value):
    """arr[index] += value atomically (sequentially consistent); returns the value before the add."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None
    sig = types.int64(arr, index, types.int64)

    def codegen(context, builder, sig, args):
        ptr = _slot_pointer(context, builder, sig.args[0], args[0], args[1])
        val = context.cast(builder, args[2], sig.args[2], types.int64)
        return builder.atomic_rmw("add", ptr, val, "seq_cst")

    return sig, codegen


@intrinsic
def atomic_load(typingctx, arr, index):
    """arr[index], read atomically with acquire ordering (never hoisted out of a spin loop)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None
    sig = types.int64(arr, index)

    def codegen(context, builder, sig, args):
        ptr = _slot_pointer(context, builder, sig.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "acquire", 8)

    return sig, codegen


@intrinsic
def atomic_store(typingctx, arr, index, value):
    """arr[index] = value atomically, with release ordering."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None
    sig = types.void(arr, index, types.int64)

    def codegen(context, builder, sig, args):
        ptr = _slot_pointer(context, builder, sig.args[0], args[0], args[1])
        val = context.cast(builder, args[2], sig.args[2], types.int64)
        builder.store_atomic(val, ptr, "release", 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def spin_pause(typingctx):
    """The CPU's spin-wait hint (x86 `pause`; nothing elsewhere)."""
    sig = types.void()

    def codegen(context, builder, sig, args):
        if _X86:  # numba's JIT has no inline assembler: the intrinsic behind _mm_pause
            void = ir.FunctionType(ir.VoidType(), [])
            fn = cgutils.get_or_insert_function(builder.module, void, "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def sched_yield(typingctx):
    """libc's sched_yield(): give this core to another runnable thread."""
    sig = types.void()

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def cycles(typingctx):
    """The CPU's cycle counter (llvm.readcyclecounter: x86's TSC, which ticks at a constant rate), for profiles."""
    sig = types.int64()

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])

    return sig, codegen


@njit(cache=True, nogil=True)
def wait_at_least(counter, index, target):
    """Spin until counter[index] >= target (another thread's atomic_add gets it there)."""
    spins = 0
    while atomic_load(counter, index) < target:
        spin_pause()
        spins += 1
        if spins >= SPINS_BEFORE_YIELD:
            sched_yield()
            spins = 0
