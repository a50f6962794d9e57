"""Compile every CUDA kernel to PTX for sm_90 on a machine without a GPU, and count float64 instructions.

The simulator runs kernels as Python, so it never types them the way the GPU compiler does; this does.
Needs NVVM and NVRTC (pip wheels nvidia-nvvm, nvidia-cuda-nvrtc, no GPU) under CUDA_HOME:
    CUDA_HOME=<dir: lib/libnvvm.so.4, lib/libnvrtc.so.13, nvvm/libdevice> python tests/kernels/ptx_check.py
Only rope_and_store and the q/k/v products (`_qkv`) should show float64 operations (angles are float64 on
purpose). Where a `ptxas` is found (on
PATH, or in CUDA_HOME/bin), each PTX is also assembled for sm_90, which catches inline-asm errors, and its
registers and spill bytes are printed.
"""

import os
import re
import shutil
import subprocess
import tempfile

import numba.cuda.dispatcher as dispatcher
import numpy as np
from numba import typeof, types

from lucekv.kernels.cuda import (
    act,
    attention,
    cuda,
    embed,
    expert_counts,
    flash,
    matmul,
    matvec,
    mmq,
    moe,
    norm,
    sample,
)
from lucekv.kernels.cuda.packed import Quant, attention_inputs, epilogue
from lucekv.kernels.cuda.rope import Rotary


class _Hopper:  # device functions ask the current device for its compute capability
    compute_capability = (9, 0)


dispatcher.get_current_device = _Hopper

F2, U2, F1, I1 = types.float32[:, ::1], types.uint32[:, ::1], types.float32[::1], types.int32[::1]
I2 = types.int32[:, ::1]
H3 = types.float16[:, :, ::1]
I64, F32, B = types.int64, types.float32, types.boolean
PART = (types.float32[:, :, ::1], types.float32[:, :, ::1], types.float32[:, :, :, ::1])
TABLES = typeof(attention.BlockTables(*(np.zeros(2, np.int32) for _ in range(4))))
ATTEND = (F2, U2, U2, I1, TABLES, I1, I2, I64, F32, *PART, F2)  # (.., positions, tree, window, ..)
FLASH = (F2, U2, U2, I1, TABLES, I1, I64, F32, F2)
# tuple arguments, typed from host arrays of the device ones' dtype, dimensions and layout
_m = np.zeros((2, 4), np.float32)
EP = typeof(epilogue((_m, _m), bias=_m[0]))
XNORM = typeof((_m, np.float32(0), True))
NORM = typeof((np.zeros(2, np.float32), np.float32(0), True))  # a norm's (weight, eps, on)
MMQ_PART = typeof(mmq.Partials(np.zeros((2, 2, 4), np.float32), np.zeros(2, np.int32)))
ROTARY = typeof(Rotary(np.zeros(4), True, True))
QK_NORM = typeof((_m[0], _m[0], np.float32(0), True))
QKV = typeof(attention_inputs(_m, *(np.zeros((2, 2, 4), np.float16) for _ in range(2)), *(np.zeros(1, np.int32),) * 2,
                              Rotary(np.zeros(4), True, True), 4, 2, bias=_m[0]))


def _quant(codes, scales, subs) -> types.Type:
    """A Quant's type: codes of that dtype, scale words (uint32 with a bias, uint16 without), sub words."""
    a = np.zeros((2, 4), np.uint32)
    return typeof(Quant(np.zeros((2, 4), codes), a, np.zeros((2, 4), scales), np.zeros((2, 4), subs), 5, 3, True,
                        True))


Q4_K = _quant(np.uint32, np.uint32, np.uint16)  # sub-scaled, with a bias
Q6_K = _quant(np.uint32, np.uint16, np.uint8)  # sub-scaled, no bias
Q8_0 = _quant(np.uint32, np.uint16, np.uint8)  # (sub words a stand-in)
MATVEC = (F2, XNORM, EP, I64, I64)
QUANTS = {"q4": Q4_K, "q6": Q6_K, "q8": Q8_0}

# kernel: argument types (return void)
CHECKS = {
    "matvec_q4": (matvec._KERNELS["q4", "rows"], (Q4_K, *MATVEC)),
    "matvec_q6": (matvec._KERNELS["q6", "rows"], (Q6_K, *MATVEC)),
    "matvec_q8": (matvec._KERNELS["q8", "rows"], (Q8_0, *MATVEC)),
    "matvec_q4_qkv": (matvec._KERNELS["q4", "qkv"], (Q4_K, F2, XNORM, QKV, I64, I64)),
    "matvec_q8_qkv": (matvec._KERNELS["q8", "qkv"], (Q8_0, F2, XNORM, QKV, I64, I64)),
    "matvec_q4_q6": (matvec._pair_kernel("q4", "q6", "rows"), (Q4_K, Q6_K, F2, XNORM, EP, EP, I64, I64, I64, I64)),
    "matvec_f32": (matvec._matvec_f32, (F2, F2, EP)),
    **{f"matvec_{kind}_tokens{n}": (matvec._tokens_kernel(kind, n), (QUANTS[kind], F2, XNORM, EP, I64, I64, I64))
       for kind in matvec.TOKEN_KINDS for n in (2, 4, 8) if n <= matvec.TOKENS_PER_BLOCK[kind]},
    "rmsnorm": (norm._rmsnorm, (F2, F1, F32, F2)),
    "gated_act": (act._gated_act, (F2, F2, B, F2)),
    "add": (act._add, (F2, F2, F2)),
    "rope_and_store_f16": (attention._rope_and_store, (F2, F2, F2, I1, I1, ROTARY, H3, H3, F2, types.float32[:, :],
                                                       QK_NORM)),
    "attend_f16_128": (attention._split_kernel(2, 64), ATTEND),
    "attend_f32_128": (attention._split_kernel(1, 128), ATTEND),
    "attend_f32_160": (attention._split_kernel(1, 160), ATTEND),
    "flash_128": (flash._kernel(128), FLASH),
    "flash_64": (flash._kernel(64), FLASH),
    "flash_128_4x3": (flash._kernel(128, 4, 3), FLASH),  # the shapes attention_speed --shapes times beside
    "flash_128_8x1": (flash._kernel(128, 8, 1), FLASH),
    "combine": (attention._combine, (PART[0], PART[1], F2, F2)),
    "set_slot_pos": (attention._set_slot_pos, (I1, I1, I1)),
    "argmax": (sample._argmax, (F2, I64, F2, types.int32[:, ::1], I1, I1)),
}
for (kind, block, shape, halves), kernel in matmul._KERNELS.items():
    CHECKS[f"matmul_{kind}_{block}_{shape.name}" + "_halves" * halves] = (kernel, (QUANTS[kind], I64, F32,
                                                                                  U2 if halves else F2, EP))
CHECKS["matmul_stage_halves"] = (matmul._stage_halves, (F2, I64, I64, U2))
for shape in matmul.TILE_SHAPES:  # the q/k and v products of a Q4_K_M model in one launch
    CHECKS[f"matmul_pair_q4_32_q6_16_{shape.name}"] = (matmul._pair_kernel(("q4", 32), ("q6", 16), shape),
                                                       (Q4_K, I64, F32, U2, EP, Q6_K, I64, F32, U2, EP))
CHECKS["matmul_f32"] = (matmul._matmul_f32, (F2, F2, EP))
for kind, quant in (*QUANTS.items(), ("f32", _quant(np.float32, np.uint8, np.uint8))):
    CHECKS[f"embed_{kind}"] = (embed._KERNELS[kind], (quant, I1, F32, F2))
for kind, quant in (("q4", Q4_K), ("f32", _quant(np.float32, np.uint8, np.uint8))):
    CHECKS[f"moe_router_{kind}"] = (moe._ROUTERS[kind], (quant, F2, XNORM, F2, I64))
CHECKS["moe_top_k"] = (moe._top_k, (F2, I2, F2, B))
for (kind, _), kernel in moe._ROUTED.items():  # an ExpertTable's (table, host, remap) first
    routed = (QUANTS[kind], QUANTS[kind], I1, I64, F2, XNORM, EP, I64, I64, I64, I2, B)
    CHECKS[f"moe{kernel.py_func.__name__}"] = (kernel, routed)
for (kind, *_), kernel in moe._GROUPED.items():
    CHECKS["moe" + kernel.py_func.__name__] = (kernel, (QUANTS[kind], QUANTS[kind], I1, I64, F32, U2, I1, I2, EP))
for (kind, _), kernel in moe._ROUTED_SUM.items():
    summed = (QUANTS[kind], QUANTS[kind], I1, I64, F2, XNORM, I2, F2, F2, F2, F2, B, F2, I64, I64, I64)
    CHECKS[f"moe{kernel.py_func.__name__}"] = (kernel, summed)
for kind, halves, bias, grouped in (("q4", False, True, True), ("q6", True, False, True), ("q6", False, True, False),
                                   ("q8", False, False, False)):
    for tiles in (1, 4, 8):  # Q4_K, Q6_K, Q5_1, Q8_0; x in one int8 part or two
        for parts in (1, 2):
            wide = mmq.sub_type(kind, 4 if halves else 5, bias, tiles, parts) == np.uint64  # a step's sub words
            subs = types.uint64[:, ::1] if wide else U2
            CHECKS[f"mmq_{kind}{'_halves' * halves}{'_bias' * bias}_tokens{8 * tiles}_parts{parts}"] = (
                mmq._kernel(kind, halves, bias, grouped, tiles, parts), (QUANTS[kind], subs, U2, F2, EP, I64, MMQ_PART))
            if tiles == 1:  # its blocks quantize x themselves (8 warps)
                CHECKS[f"mmq_{kind}{'_halves' * halves}{'_bias' * bias}_tokens8_parts{parts}_quantizing"] = (
                    mmq._kernel(kind, halves, bias, grouped, tiles, parts, 8),
                    (QUANTS[kind], subs, F2, NORM, EP, I64, MMQ_PART))
CHECKS["mmq_quantize"] = (mmq._quantize_kernel, (F2, NORM, U2, F2))
CHECKS["mmq_reduce"] = (mmq._reduce_kernel, (types.float32[:, :, ::1], EP, I64, I64))
CHECKS["moe_routed_f32"] = (moe._routed_f32, (F2, F2, I1, I64, F2, I2, B, EP))
for kind, quant in (("q4", Q4_K), ("f32", _quant(np.float32, np.uint8, np.uint8))):
    CHECKS[f"moe_router_parts_{kind}"] = (moe._ROUTER_PARTS[kind], (quant, F2, types.float32[:, :, ::1]))
CHECKS["moe_sum_top_k"] = (moe._sum_top_k, (types.float32[:, :, ::1], I64, F2, I2, F2, B))
CHECKS["moe_count"] = (moe._count, (I2, I64, I2, I2))
CHECKS["moe_place"] = (moe._place, (I2, I64, I2, I1, I2, I1, I2))
CHECKS["moe_gather"] = (moe._gather, (F2, I1, I64, I64, U2))
CHECKS["moe_combine"] = (moe._combine, (F2, I2, F2, F2, F2, F2, B, F2))
CHECKS["expert_counts_count"] = (expert_counts._count, (I2, I1, I1))
CHECKS["expert_counts_clear"] = (expert_counts._clear, (I1,))


def find_ptxas() -> str | None:
    home = os.environ.get("CUDA_HOME", "")
    at_home = os.path.join(home, "bin", "ptxas")
    return shutil.which("ptxas") or (at_home if home and os.access(at_home, os.X_OK) else None)


def assemble(ptxas: str, ptx: str) -> str:
    """Registers and spill bytes of `ptx` assembled for sm_90; raises with ptxas's message on errors."""
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ptx")
        with open(source, "w") as f:
            f.write(ptx)
        done = subprocess.run([ptxas, "-arch=sm_90", "-v", source, "-o", os.path.join(tmp, "kernel.cubin")],
                              capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr.strip())
    registers = re.search(r"Used (\d+) registers", done.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", done.stderr)
    return f"registers: {registers[1]:>3s}  spills: {spills[1]} B stored, {spills[2]} B loaded"


if __name__ == "__main__":
    ptxas = find_ptxas()
    print(f"ptxas: {ptxas or 'not found, PTX not assembled'}")
    failed = 0
    for name, (kernel, sig) in CHECKS.items():
        try:
            bounds = kernel.targetoptions.get("launch_bounds")
            ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0), launch_bounds=bounds)
            assembled = f"  {assemble(ptxas, ptx)}" if ptxas else ""
            print(f"{name:14s} ok    float64 ops: {len(re.findall(r'[.]f64', ptx))}{assembled}")
        except Exception as e:  # report every kernel, then fail
            failed += 1
            print(f"{name:14s} FAIL  {type(e).__name__}: {str(e)[:800]}")
    raise SystemExit(1 if failed else 0)
