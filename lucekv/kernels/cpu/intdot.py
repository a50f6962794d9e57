"""Integer dot products of quantized weight rows with int16 activations, emitted as LLVM IR (numba intrinsics).

A decode step quantizes each input row once to int16 codes per 32-block (`quantize_x16`: x ~ xd * xq, xd = max|x|
/ 32767, a relative 1.5e-5 of the block's largest element); a weight block's integer codes times those codes,
summed exactly in int32, are converted to float once per block and scaled by the weight's scale times xd. numba's
loop vectorizer, left to itself, converted every code to float or multiplied in 32-bit lanes (16 products per
instruction at best: the products were instruction-bound at 7-8 GB/s); written as IR here, a 32-block is two
256-bit `vpmaddwd` (16 products summed in pairs each), one convert and one fused multiply-add into 8 float lanes.
Without AVX2 (or with NUMBA_CPU_NAME set, e.g. for a portable cache) the same sums are plain vector IR that any
target lowers; the sums are exact integers either way (|code| <= 128, |xq| <= 32767: four products fit int32),
so both give the same bits.

8-bit activations (llama.cpp's q8 blocks, `vpmaddubsw`: 32 products an instruction) were measured faster still
but put the logits 1-7% (relative) off the float path on smollm2-135m and flipped greedy tokens (issue 28's notes).
"""

from __future__ import annotations

import platform

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils, config
from numba.extending import intrinsic

X_BLOCK = 32  # elements per activation scale

_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()


def _vec(t, n):
    return ir.VectorType(t, n)


def _native_avx2() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64") or config.CPU_NAME:
        return False
    features = llvm.get_host_cpu_features()
    return bool(features.get("avx2")) and bool(features.get("fma"))


NATIVE = _native_avx2()


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _ptr(context, builder, arr_type, arr, index):
    ary = context.make_array(arr_type)(context, builder, arr)
    return cgutils.get_item_pointer(context, builder, arr_type, ary, [index])


def _load(builder, ptr, index, vty):
    return builder.load(builder.bitcast(builder.gep(ptr, [index]), vty.as_pointer()), align=1)


def _lanes(*idx):
    return ir.Constant(_vec(_I32, len(idx)), list(idx))


def _shuffle(builder, v, idx):
    return builder.shuffle_vector(v, v, _lanes(*idx))


def _splat(builder, x, n):
    v = builder.insert_element(ir.Constant(_vec(x.type, n), ir.Undefined), x, ir.Constant(_I32, 0))
    return _shuffle(builder, v, [0] * n)


def _pair_sums(builder, w_halves, x, native):
    """Two <8 x i32>: lane k of the first = w[2k] x[2k] + w[2k + 1] x[2k + 1] over elements 0..15, of the second
    the same over 16..31 (w_halves: the weight codes as two <16 x i16>; x <32 x i16>)."""
    sums = []
    for h, wh in enumerate(w_halves):
        xh = _shuffle(builder, x, range(16 * h, 16 * h + 16))
        if native:
            fn = _fn(builder, "llvm.x86.avx2.pmadd.wd", _vec(_I32, 8), [_vec(_I16, 16)] * 2)
            sums.append(builder.call(fn, [wh, xh]))
        else:
            p = builder.mul(builder.sext(wh, _vec(_I32, 16)), builder.sext(xh, _vec(_I32, 16)))
            sums.append(builder.add(_shuffle(builder, p, range(0, 16, 2)), _shuffle(builder, p, range(1, 16, 2))))
    return sums


def _weight_halves(builder, cp, c, kind):
    """Chunk c's 32 weight codes as two <16 x i16> (elements 0..15, 16..31). q4: 16 bytes, the low nibbles
    elements 0..15 and the high ones 16..31, widened before they are split (x86 has no byte shifts)."""
    if kind == "q4":
        raw = builder.zext(_load(builder, cp, builder.mul(c, ir.Constant(_I64, 16)), _vec(_I8, 16)), _vec(_I16, 16))
        return (builder.and_(raw, ir.Constant(_vec(_I16, 16), [15] * 16)),
                builder.lshr(raw, ir.Constant(_vec(_I16, 16), [4] * 16)))
    w = builder.sext(_load(builder, cp, builder.mul(c, ir.Constant(_I64, 32)), _vec(_I8, 32)), _vec(_I16, 32))
    return _shuffle(builder, w, range(16)), _shuffle(builder, w, range(16, 32))


def _hsum(builder, v):
    """A float <8 x float>'s lanes summed in a fixed order: halves, then halves again."""
    s4 = builder.fadd(_shuffle(builder, v, [0, 1, 2, 3]), _shuffle(builder, v, [4, 5, 6, 7]))
    s2 = builder.fadd(_shuffle(builder, s4, [0, 1]), _shuffle(builder, s4, [2, 3]))
    return builder.fadd(builder.extract_element(s2, ir.Constant(_I32, 0)),
                        builder.extract_element(s2, ir.Constant(_I32, 1)))


def _counted_loop(builder, n, name, body, inits):
    """Emit `for i in range(n): state = body(i, state)` from state `inits`; returns the final state."""
    entry = builder.block
    loop, after = builder.append_basic_block(f"intdot.{name}"), builder.append_basic_block(f"intdot.{name}_end")
    builder.cbranch(builder.icmp_signed(">", n, ir.Constant(_I64, 0)), loop, after)
    builder.position_at_end(loop)
    i = builder.phi(_I64)
    state = [builder.phi(v.type) for v in inits]
    nxt = body(i, state)
    i_next = builder.add(i, ir.Constant(_I64, 1))
    body_end = builder.block
    for phi, init, v in zip([i, *state], [ir.Constant(_I64, 0), *inits], [i_next, *nxt], strict=True):
        phi.add_incoming(init, entry)
        phi.add_incoming(v, body_end)
    builder.cbranch(builder.icmp_signed("<", i_next, n), loop, after)
    builder.position_at_end(after)
    out = [builder.phi(v.type) for v in inits]
    for phi, init, v in zip(out, inits, nxt, strict=True):
        phi.add_incoming(init, entry)
        phi.add_incoming(v, body_end)
    return out


def _dot_codegen(kind, native):
    """Codegen of sum over 32-element chunks c < n of (scale-weighted integer dot of chunk c), then the bias terms
    bias[b] * xsum[b] over n_bias blocks b (none for a weight without biases). kind "q4": chunk c is 16 bytes of
    nibbles (low nibbles elements 0..15, high 16..31), one weight block; "q8": 32 int8 codes, one block; "q8_16": 32
    int8 codes, two 16-blocks (one scale each). Even and odd chunks go to two accumulators (one FMA chain would wait
    on its own latency every chunk); the bias terms 8 blocks at a time, then one by one."""
    blocks = 2 if kind == "q8_16" else 1  # weight blocks a chunk

    def codegen(context, builder, sig, args):
        cp, xp, sp, dp, bp, tp = (_ptr(context, builder, sig.args[i], args[i], args[i + 1])
                                  for i in (0, 2, 4, 6, 9, 11))
        n, n_bias = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (8, 13))
        fma = _fn(builder, "llvm.fma.v8f32", _vec(_F32, 8), [_vec(_F32, 8)] * 3)
        fma1 = _fn(builder, "llvm.fma.f32", _F32, [_F32] * 3)
        one, two, eight = ir.Constant(_I64, 1), ir.Constant(_I64, 2), ir.Constant(_I64, 8)

        def chunk(c, acc):
            """acc + chunk c's sums times their scales."""
            x = _load(builder, xp, builder.mul(c, ir.Constant(_I64, X_BLOCK)), _vec(_I16, 32))
            halves = _pair_sums(builder, _weight_halves(builder, cp, c, kind), x, native)
            xd = builder.load(builder.gep(dp, [c]))
            if blocks == 1:
                halves = [builder.add(*halves)]
            for k, sums in enumerate(halves):
                b = builder.add(builder.mul(c, ir.Constant(_I64, blocks)), ir.Constant(_I64, k))
                s = _splat(builder, builder.fmul(builder.load(builder.gep(sp, [b])), xd), 8)
                acc = builder.call(fma, [builder.sitofp(sums, _vec(_F32, 8)), s, acc])
            return acc

        zero, fzero = ir.Constant(_vec(_F32, 8), [0.0] * 8), ir.Constant(_F32, 0.0)
        even, odd = _counted_loop(builder, builder.ashr(n, one), "pairs", lambda i, st: [
            chunk(builder.mul(i, two), st[0]), chunk(builder.add(builder.mul(i, two), one), st[1])], [zero, zero])
        (even,) = _counted_loop(builder, builder.and_(n, one), "odd_chunk",  # the last chunk of an odd count
                                lambda i, st: [chunk(builder.sub(n, one), st[0])], [even])
        (bias8,) = _counted_loop(builder, builder.ashr(n_bias, ir.Constant(_I64, 3)), "bias8", lambda i, st: [
            builder.call(fma, [_load(builder, bp, builder.mul(i, eight), _vec(_F32, 8)),
                               _load(builder, tp, builder.mul(i, eight), _vec(_F32, 8)), st[0]])], [zero])
        rest = builder.and_(n_bias, ir.Constant(_I64, 7))
        done8 = builder.sub(n_bias, rest)
        (bias1,) = _counted_loop(builder, rest, "bias1", lambda i, st: [builder.call(fma1, [
            *(builder.load(builder.gep(p, [builder.add(done8, i)])) for p in (bp, tp)), st[0]])], [fzero])
        return builder.fadd(_hsum(builder, builder.fadd(even, odd)), builder.fadd(_hsum(builder, bias8), bias1))

    return codegen


def _dot_intrinsic(kind, native):
    def typer(typingctx, codes, c_at, xq, x_at, scale, s_at, xd, d_at, n, bias, b_at, xsum, t_at, n_bias):
        arrays = (codes, xq, scale, xd, bias, xsum)
        dtypes = (types.uint8, types.int16, types.float32, types.float32, types.float32, types.float32)
        if not all(isinstance(a, types.Array) and a.ndim == 1 and a.dtype == d
                   for a, d in zip(arrays, dtypes, strict=True)):
            return None
        sig = types.float32(codes, c_at, xq, x_at, scale, s_at, xd, d_at, n, bias, b_at, xsum, t_at, n_bias)
        return sig, _dot_codegen(kind, native)

    typer.__name__ = f"dot_{kind}_{'native' if native else 'generic'}"
    return intrinsic(typer)


# dot(codes, c_at, xq, x_at, scale, s_at, xd, d_at, n, bias, b_at, xsum, t_at, n_bias): float32 sum over n chunks of
# 32 elements, starting at codes[c_at] (flat bytes), xq[x_at], scale[s_at] (one per weight block) and xd[d_at] (one
# per 32 activations), of each chunk's integer code products times its scale and xd; plus the sum of
# bias[b_at + b] * xsum[t_at + b] over n_bias blocks b (x's float block sums; n_bias 0 for a weight without biases).
# The generic forms exist for the tests on AVX2 machines.
dot_q4, dot_q8, dot_q8_16 = (_dot_intrinsic(k, NATIVE) for k in ("q4", "q8", "q8_16"))
dot_q4_generic, dot_q8_generic, dot_q8_16_generic = (_dot_intrinsic(k, False) for k in ("q4", "q8", "q8_16"))


@intrinsic
def prefetch(typingctx, arr, index):
    """Hint the cache to fetch the line of arr[index] (llvm.prefetch: a read, kept in all levels; it never faults,
    but callers keep index within the array so the address arithmetic stays defined)."""
    if not isinstance(arr, types.Array):
        return None
    sig = types.void(arr, index)

    def codegen(context, builder, sig, args):
        ptr = builder.bitcast(_ptr(context, builder, sig.args[0], args[0], args[1]), ir.IntType(8).as_pointer())
        fn = _fn(builder, "llvm.prefetch.p0i8", ir.VoidType(), [ir.IntType(8).as_pointer(), _I32, _I32, _I32])
        builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def quantize_x16(x, xq, xd):
    """x (float32, whole 32-blocks) as int16 codes xq and one float32 scale per 32-block, xd = max|x| / 32767:
    x ~ xd * xq within xd / 2 (a relative 1.5e-5 of the block's largest element)."""
    for b in range(x.shape[0] // X_BLOCK):
        block = x[b * X_BLOCK:(b + 1) * X_BLOCK]
        d = _abs_max(block) / np.float32(32767)
        xd[b] = d
        _round_codes(block, np.float32(1) / d if d > 0 else np.float32(0), xq[b * X_BLOCK:(b + 1) * X_BLOCK])


# The two loops of quantize_x16, vectorized by fastmath's flags (2.4x faster on 128 x 4864 floats): a maximum is
# exact in any order, and one multiply and round have nothing to reassociate. A NaN in x gives code 0, as it did
# before (the comparisons of max() skip it).
@njit(cache=True, nogil=True, fastmath=True)
def _abs_max(x):
    m = np.float32(0)
    for j in range(x.shape[0]):
        m = max(m, abs(x[j]))
    return m


@njit(cache=True, nogil=True, fastmath={"nnan", "ninf", "nsz"})
def _round_codes(x, inv, out):
    for j in range(x.shape[0]):
        out[j] = np.int16(np.rint(x[j] * inv))


# ---- prefill: a tile of weight rows against 16 tokens at once ----------------------------------------------------
#
# A prompt's products are compute-bound, and a 32-block's float work (convert, scale, fused add) costs as much as its
# integer products when each (row, token) pair gets its own 8 lanes (the decode kernels above). Here the tokens are
# the lanes instead: x comes transposed, each 32-bit lane of a vector one token's pair of int16 codes (elements 2p,
# 2p + 1), and a weight row's pair of codes is broadcast against it. One `vpdpwssd` (AVX-512 VNNI) then adds 32
# products into 16 tokens' int32 sums, and a block's float work is one convert, one multiply and one fused add (two
# with bias terms) per 16 tokens.
# On this repository's development Xeon (Sapphire Rapids) `vpdpwssd zmm` issues twice a cycle, as `vfmadd zmm`:
# twice float32 BLAS's products a cycle. A token's number depends on its own lane alone, so on nothing else in the
# prompt. Each block's int32 sums are exact (|code| <= 128, |xq| <= 32767, 32 products: < 2^31); the convert rounds
# a sum beyond 2^24 (a relative 6e-8).

TILE_ROWS = 16  # weight rows a tile: 16 accumulators in flight cover vpdpwssd's latency at two a cycle
TILE_TOKENS = 16  # tokens a tile: one 512-bit vector of int32 lanes


def _native_vnni() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64") or config.CPU_NAME:
        return False
    features = llvm.get_host_cpu_features()
    return all(features.get(f) for f in ("avx512f", "avx512bw", "avx512vnni"))


NATIVE_VNNI = _native_vnni()
if NATIVE_VNNI:
    llvm.initialize_native_asmparser()  # the object code of a kernel with inline asm (numba leaves it out)


def _pair_dot(builder, acc, x, w, native):
    """acc + per 32-bit lane: x.lo * w.lo + x.hi * w.hi (the two int16 halves of each int32 lane, 16 lanes)."""
    v16 = _vec(_I32, TILE_TOKENS)
    if native:  # as inline asm: LLVM, tuning for the CPU it takes this one for, splits the intrinsic in two
        asm = ir.InlineAsm(ir.FunctionType(v16, [v16] * 3), "vpdpwssd $2, $1, $0", "=v,v,v,0")
        return builder.call(asm, [x, w, acc])
    v32 = _vec(_I16, 2 * TILE_TOKENS)
    p = builder.mul(builder.sext(builder.bitcast(x, v32), _vec(_I32, 2 * TILE_TOKENS)),
                    builder.sext(builder.bitcast(w, v32), _vec(_I32, 2 * TILE_TOKENS)))
    lanes = range(2 * TILE_TOKENS)
    return builder.add(acc, builder.add(_shuffle(builder, p, lanes[0::2]), _shuffle(builder, p, lanes[1::2])))


def _tile_codegen(block_pairs, with_bias, native):
    """Codegen of one tile (TILE_ROWS weight rows x TILE_TOKENS tokens) over n_blocks weight blocks of block_pairs
    pairs of elements (16: 32-blocks, 8: 16-blocks). Per block and row: the int32 sums of the block's pairs (one
    accumulator a row: 16 independent chains), converted and multiplied by the row's block scale times each token's
    xd, added to the row's 16 float lanes; with_bias: then the row's block bias times each token's block sum of x.
    (8 rows with two accumulators each measured 1.1-1.3x slower.)"""
    def codegen(context, builder, sig, args):
        w, xp, xd, sc, bi, xs, out = (_ptr(context, builder, sig.args[i], args[i], ir.Constant(_I64, 0))
                                      for i in range(7))
        n_blocks = context.cast(builder, args[7], sig.args[7], types.int64)
        v16i, v16f = _vec(_I32, TILE_TOKENS), _vec(_F32, TILE_TOKENS)
        fma = _fn(builder, "llvm.fma.v16f32", v16f, [v16f] * 3)
        n_pairs = builder.mul(n_blocks, ir.Constant(_I64, block_pairs))
        row_at = [builder.mul(n_pairs, ir.Constant(_I64, i)) for i in range(TILE_ROWS)]
        zero_i, zero_f = ir.Constant(v16i, [0] * TILE_TOKENS), ir.Constant(v16f, [0.0] * TILE_TOKENS)

        def block(b, accs):
            p0 = builder.mul(b, ir.Constant(_I64, block_pairs))
            sums = [zero_i] * TILE_ROWS
            for p in range(block_pairs):
                pair = builder.add(p0, ir.Constant(_I64, p))
                x = _load(builder, xp, builder.mul(pair, ir.Constant(_I64, TILE_TOKENS)), v16i)
                for i in range(TILE_ROWS):
                    wv = _splat(builder, builder.load(builder.gep(w, [builder.add(row_at[i], pair)])), TILE_TOKENS)
                    sums[i] = _pair_dot(builder, sums[i], x, wv, native)
            # the 32-block of x this weight block lies in (a 16-block: every other block shares one)
            xb = b if 2 * block_pairs == X_BLOCK else builder.ashr(b, ir.Constant(_I64, 1))
            xdv = _load(builder, xd, builder.mul(xb, ir.Constant(_I64, TILE_TOKENS)), v16f)
            xsv = _load(builder, xs, builder.mul(b, ir.Constant(_I64, TILE_TOKENS)), v16f) if with_bias else None
            new = []
            for i in range(TILE_ROWS):
                at = builder.add(builder.mul(n_blocks, ir.Constant(_I64, i)), b)
                s = builder.fmul(_splat(builder, builder.load(builder.gep(sc, [at])), TILE_TOKENS), xdv)
                acc = builder.call(fma, [builder.sitofp(sums[i], v16f), s, accs[i]])
                if with_bias:
                    acc = builder.call(fma, [_splat(builder, builder.load(builder.gep(bi, [at])), TILE_TOKENS), xsv,
                                             acc])
                new.append(acc)
            return new

        accs = _counted_loop(builder, n_blocks, f"tile{block_pairs}", block, [zero_f] * TILE_ROWS)
        for i, acc in enumerate(accs):
            builder.store(acc, builder.bitcast(builder.gep(out, [ir.Constant(_I64, i * TILE_TOKENS)]),
                                               v16f.as_pointer()), align=4)
        return context.get_dummy_value()

    return codegen


def _tile_intrinsic(block_pairs, with_bias, native):
    def typer(typingctx, w, xp, xd, scale, bias, xsum, out, n_blocks):
        arrays = (w, xp, xd, scale, bias, xsum, out)
        dtypes = (types.int32, types.int32, types.float32, types.float32, types.float32, types.float32, types.float32)
        if not all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype == d
                   for a, d in zip(arrays, dtypes, strict=True)):
            return None
        return types.void(w, xp, xd, scale, bias, xsum, out, n_blocks), _tile_codegen(block_pairs, with_bias, native)

    typer.__name__ = f"tile_{block_pairs}{'_bias' if with_bias else ''}_{'native' if native else 'generic'}"
    return intrinsic(typer)


# tile_*(w, xp, xd, scale, bias, xsum, out, n_blocks): out [TILE_ROWS * TILE_TOKENS] (row-major: row i's 16 tokens) =
# for each of TILE_ROWS weight rows and TILE_TOKENS tokens, the sum over n_blocks weight blocks of the block's integer
# products times scale * xd (+ bias * xsum). w: int32 [TILE_ROWS * n_pairs] (row i's codes as pairs of int16, lo =
# element 2p); xp: int32 [n_pairs * 16] (pair p of each token's int16 codes); xd: float32 [cols / 32 * 16] (each
# token's scale per 32-block); scale, bias: float32 [TILE_ROWS * n_blocks]; xsum: float32 [n_blocks * 16] (each
# token's float sum over each weight block). 32 or 16 elements a block; _bias: with the bias terms.
tile_32, tile_32_bias, tile_16, tile_16_bias = (_tile_intrinsic(p, b, NATIVE_VNNI)
                                                for p in (16, 8) for b in (False, True))
tile_32_generic, tile_32_bias_generic, tile_16_generic, tile_16_bias_generic = (
    _tile_intrinsic(p, b, False) for p in (16, 8) for b in (False, True))
