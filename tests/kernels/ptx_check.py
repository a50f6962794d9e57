"""Compile every CUDA kernel to PTX for sm_90 on a machine without a GPU, and count float64 instructions.

The simulator runs kernels as Python, so it never types them the way the GPU compiler does; this does.
Needs NVVM and NVRTC (pip wheels nvidia-nvvm, nvidia-cuda-nvrtc, no GPU) under CUDA_HOME:
    CUDA_HOME=<dir: lib/libnvvm.so.4, lib/libnvrtc.so.13, nvvm/libdevice> python tests/kernels/ptx_check.py
Only rope should show float64 operations (its angles are float64 on purpose).
"""

import re

import numba.cuda.dispatcher as dispatcher

from lucekv.kernels.cuda import act, attention, cuda, embed, matmul, matvec, norm, rope, sample


class _Hopper:  # device functions ask the current device for its compute capability
    compute_capability = (9, 0)


dispatcher.get_current_device = _Hopper

F2, U2, F1, I1 = "float32[:, ::1]", "uint32[:, ::1]", "float32[::1]", "int32[::1]"
PART = "float32[:, :, ::1], float32[:, :, ::1], float32[:, :, :, ::1]"


ATTEND = f"void({F2}, {U2}, {U2}, int64, {I1}, {I1}, {I1}, int64, float32, {PART})"


CHECKS = {
    "matvec_q4": (matvec._matvec_q4, f"void({U2}, {F2}, {F2}, boolean, {F2}, {F2}, int64, int64)"),
    "matvec_q8": (matvec._matvec_q8, f"void({U2}, {F2}, {F2}, boolean, int64, {F2}, {F2}, int64, int64)"),
    "matvec_f32": (matvec._matvec_f32, f"void({F2}, {F2}, {F2})"),
    "rmsnorm": (norm._rmsnorm, f"void({F2}, {F1}, float32, {F2})"),
    "rope": (rope._rope, f"void({F2}, int64, int64, {I1}, float64[::1], float64, boolean)"),
    "gated_act": (act._gated_act, f"void({F2}, {F2}, boolean, {F2})"),
    "add": (act._add, f"void({F2}, {F2}, {F2})"),
    "add_row": (act._add_row, f"void({F2}, {F1}, {F2})"),
    "store_kv_f16": (attention._store_kv, f"void({F2}, {F2}, {I1}, float16[:, :, ::1], float16[:, :, ::1])"),
    "attend_f16": (attention._attend_split_f16, ATTEND),
    "attend_f32": (attention._attend_split_f32, ATTEND),
    "combine": (attention._combine, f"void({PART}, {F2})"),
    "set_slot_pos": (attention._set_slot_pos, f"void({I1}, {I1}, {I1})"),
    "argmax": (sample._argmax, f"void({F2}, {I1})"),
}
for kind, codes in (("q4", U2), ("q8", U2), ("f32", F2)):
    CHECKS[f"matmul_{kind}"] = (matmul._KERNELS[kind], f"void({codes}, {F2}, {F2}, int64, int64, {F2}, {F2})")
    CHECKS[f"embed_{kind}"] = (embed._KERNELS[kind], f"void({codes}, {F2}, {F2}, int64, {I1}, float32, {F2})")

if __name__ == "__main__":
    failed = 0
    for name, (kernel, sig) in CHECKS.items():
        try:
            ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
            print(f"{name:14s} ok    float64 ops: {len(re.findall(r'[.]f64', ptx))}")
        except Exception as e:  # report every kernel, then fail
            failed += 1
            print(f"{name:14s} FAIL  {type(e).__name__}: {str(e)[:800]}")
    raise SystemExit(1 if failed else 0)
