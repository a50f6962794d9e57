"""Integer products of quantized weights with int16 activations, emitted as LLVM IR (numba intrinsics).

Activations are quantized once per op to int16 codes per 32-block (`quantize_x16`: x ~ xd * xq, xd = max|x| / 32767,
a relative 1.5e-5 of the block's largest element); a weight block's integer codes times those codes, summed exactly
in int32, are converted to float once per block and scaled by the weight's scale times xd. Two kernels, both with
AVX-512 VNNI's `vpdpwssd` (32 int16 products into 16 int32 lanes) where the CPU has it, else the same sums as plain
vector IR (the same bits: the int32 sums are exact): prefill tiles (16 weight rows x 16 tokens, the tokens the
lanes) and decode groups (16 weight rows against one token, the rows the lanes). numba's loop vectorizer, left to
itself, converted every code to float or multiplied in 32-bit lanes: instruction-bound at 7-8 GB/s.

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

from lucekv.kernels.cpu.quants import GROUP_ROWS  # weight rows a group: one 512-bit vector of int32 lanes

X_BLOCK = 32  # elements per activation scale

_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()


def _vec(t, n):
    return ir.VectorType(t, n)


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
# integer products when each (row, token) pair gets its own 8 lanes (a row-by-row dot product). Here the tokens are
# the lanes instead: x comes transposed, each 32-bit lane of a vector one token's pair of int16 codes (elements 2p,
# 2p + 1), and a weight row's pair of codes is broadcast against it. One `vpdpwssd` (AVX-512 VNNI) then adds 32
# products into 16 tokens' int32 sums, and a block's float work is one convert, one multiply and one fused add (two
# with bias terms) per 16 tokens.
# On this repository's development Xeon (Sapphire Rapids) `vpdpwssd zmm` issues twice a cycle, as `vfmadd zmm`:
# twice float32 BLAS's products a cycle. A token's number depends on its own lane alone, so on nothing else in the
# prompt. Each block's int32 sums are exact (|code| <= 128, |xq| <= 32767, 32 products: < 2^31); the convert rounds
# a sum beyond 2^24 (a relative 6e-8).

TILE_ROWS = GROUP_ROWS  # weight rows a tile: 16 accumulators in flight cover vpdpwssd's latency at two a cycle
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
        zero_i, zero_f = ir.Constant(v16i, [0] * TILE_TOKENS), ir.Constant(v16f, [0.0] * TILE_TOKENS)

        def block(b, accs):
            p0 = builder.mul(b, ir.Constant(_I64, block_pairs))
            sums = [zero_i] * TILE_ROWS
            for p in range(block_pairs):
                pair = builder.add(p0, ir.Constant(_I64, p))
                x = _load(builder, xp, builder.mul(pair, ir.Constant(_I64, TILE_TOKENS)), v16i)
                for i in range(TILE_ROWS):
                    at = builder.add(builder.mul(pair, ir.Constant(_I64, TILE_ROWS)), ir.Constant(_I64, i))
                    wv = _splat(builder, builder.load(builder.gep(w, [at])), TILE_TOKENS)
                    sums[i] = _pair_dot(builder, sums[i], x, wv, native)
            # the 32-block of x this weight block lies in (a 16-block: every other block shares one)
            xb = b if 2 * block_pairs == X_BLOCK else builder.ashr(b, ir.Constant(_I64, 1))
            xdv = _load(builder, xd, builder.mul(xb, ir.Constant(_I64, TILE_TOKENS)), v16f)
            xsv = _load(builder, xs, builder.mul(b, ir.Constant(_I64, TILE_TOKENS)), v16f) if with_bias else None
            new = []
            for i in range(TILE_ROWS):
                at = builder.add(builder.mul(b, ir.Constant(_I64, TILE_ROWS)), ir.Constant(_I64, i))
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
# products times scale * xd (+ bias * xsum). w: int32 [n_pairs * TILE_ROWS] (pair p of row i, two int16 codes with
# lo = element 2p, at p * TILE_ROWS + i); xp: int32 [n_pairs * 16] (pair p of each token's int16 codes); xd: float32
# [cols / 32 * 16] (each token's scale per 32-block); scale, bias: float32 [n_blocks * TILE_ROWS] (block b of row i at
# b * TILE_ROWS + i: a group's in the grouped form, quants.group_rows); xsum: float32 [n_blocks * 16] (each token's
# float sum over each weight block). 32 or 16 elements a block; _bias: with the bias terms.
tile_32, tile_32_bias, tile_16, tile_16_bias = (_tile_intrinsic(p, b, NATIVE_VNNI)
                                                for p in (16, 8) for b in (False, True))
tile_32_generic, tile_32_bias_generic, tile_16_generic, tile_16_bias_generic = (
    _tile_intrinsic(p, b, False) for p in (16, 8) for b in (False, True))


# ---- decode: one token against 16 weight rows at once ------------------------------------------------------------
#
# The decode products turned around the same way: the weight rows are the lanes. A matrix's codes are stored by groups
# of 16 rows (quants.group_rows): pair p of the 16 rows side by side, so one load widens into 16 int32 lanes,
# each one row's pair of codes as two int16, and the token's pair of int16 codes is broadcast against them: one
# `vpdpwssd` adds 32 products into 16 rows' sums. A block's float work is one convert, one multiply and one fused add
# (two with bias terms) per 16 rows, and nothing is summed across lanes. Lane by lane it is the tile kernel's
# arithmetic (the same exact int32 block sums, the same float steps in the same order), so a token's product equals
# its prefill tile's bit for bit where its x is prepared the same.

def _group_pairs(builder, cp, pair, kind):
    """The 16 rows' codes of element pair `pair` as <16 x i32> (each lane two int16). q4: a byte a row, the pair's
    elements its low and high nibble; q8: two int8 a row."""
    if kind == "q4":
        v = builder.zext(_load(builder, cp, builder.mul(pair, ir.Constant(_I64, GROUP_ROWS)), _vec(_I8, GROUP_ROWS)),
                         _vec(_I32, GROUP_ROWS))
        both = builder.or_(v, builder.shl(v, ir.Constant(_vec(_I32, GROUP_ROWS), [12] * GROUP_ROWS)))
        return builder.and_(both, ir.Constant(_vec(_I32, GROUP_ROWS), [0x000F000F] * GROUP_ROWS))
    w = _load(builder, cp, builder.mul(pair, ir.Constant(_I64, 2 * GROUP_ROWS)), _vec(_I8, 2 * GROUP_ROWS))
    return builder.bitcast(builder.sext(w, _vec(_I16, 2 * GROUP_ROWS)), _vec(_I32, GROUP_ROWS))


def _load_factors(builder, ptr, at, halves):
    """16 rows' scales (or biases) from ptr[at] as <16 x float>: float32, or float16 bits widened (exact)."""
    if not halves:
        return _load(builder, ptr, at, _vec(_F32, GROUP_ROWS))
    bits = _load(builder, ptr, at, _vec(_I16, GROUP_ROWS))
    return builder.fpext(builder.bitcast(bits, _vec(ir.HalfType(), GROUP_ROWS)), _vec(_F32, GROUP_ROWS))


def _group_codegen(kind, with_bias, native):
    """Codegen of one group (16 rows) against one token over n_blocks weight blocks (32 elements; q8_16: 16). Per
    block the pairs alternate between two int32 accumulators (exact, added before the convert); per block and row
    the tile kernel's float steps."""
    block_pairs = 8 if kind == "q8_16" else 16

    def codegen(context, builder, sig, args):
        cp, xp, sp, dp, bp, tp, op = (_ptr(context, builder, sig.args[i], args[i], args[i + 1])
                                      for i in (0, 2, 4, 6, 9, 11, 13))
        n_blocks = context.cast(builder, args[8], sig.args[8], types.int64)
        halves = sig.args[4].dtype == types.uint16  # scales and biases as float16 bits
        v16i, v16f = _vec(_I32, GROUP_ROWS), _vec(_F32, GROUP_ROWS)
        fma = _fn(builder, "llvm.fma.v16f32", v16f, [v16f] * 3)
        zero_i, zero_f = ir.Constant(v16i, [0] * GROUP_ROWS), ir.Constant(v16f, [0.0] * GROUP_ROWS)

        def block(b, st):
            p0 = builder.mul(b, ir.Constant(_I64, block_pairs))
            sums = [zero_i, zero_i]
            for p in range(block_pairs):
                pair = builder.add(p0, ir.Constant(_I64, p))
                x = _splat(builder, builder.load(builder.gep(xp, [pair])), GROUP_ROWS)
                sums[p % 2] = _pair_dot(builder, sums[p % 2], x, _group_pairs(builder, cp, pair, kind), native)
            xb = b if block_pairs == 16 else builder.ashr(b, ir.Constant(_I64, 1))  # the x block it lies in
            at = builder.mul(b, ir.Constant(_I64, GROUP_ROWS))
            s = builder.fmul(_load_factors(builder, sp, at, halves),
                             _splat(builder, builder.load(builder.gep(dp, [xb])), GROUP_ROWS))
            acc = builder.call(fma, [builder.sitofp(builder.add(*sums), v16f), s, st[0]])
            if with_bias:
                acc = builder.call(fma, [_load_factors(builder, bp, at, halves),
                                         _splat(builder, builder.load(builder.gep(tp, [b])), GROUP_ROWS), acc])
            return [acc]

        (acc,) = _counted_loop(builder, n_blocks, f"group_{kind}", block, [zero_f])
        builder.store(acc, builder.bitcast(op, v16f.as_pointer()), align=4)
        return context.get_dummy_value()

    return codegen


def _group_intrinsic(kind, with_bias, native):
    def typer(typingctx, codes, c_at, xp, x_at, scale, s_at, xd, d_at, n_blocks, bias, b_at, xsum, t_at, out, o_at):
        arrays = (codes, xp, scale, xd, bias, xsum, out)
        factors = getattr(scale, "dtype", None)  # float32, or float16 bits (uint16): bias the same
        dtypes = (types.uint8, types.int32, factors, types.float32, factors, types.float32, types.float32)
        if factors not in (types.float32, types.uint16) or not all(
                isinstance(a, types.Array) and a.ndim == 1 and a.dtype == d
                for a, d in zip(arrays, dtypes, strict=True)):
            return None
        sig = types.void(codes, c_at, xp, x_at, scale, s_at, xd, d_at, n_blocks, bias, b_at, xsum, t_at, out, o_at)
        return sig, _group_codegen(kind, with_bias, native)

    typer.__name__ = f"group_{kind}{'_bias' if with_bias else ''}_{'native' if native else 'generic'}"
    return intrinsic(typer)


# group_*(codes, c_at, xp, x_at, scale, s_at, xd, d_at, n_blocks, bias, b_at, xsum, t_at, out, o_at): out[o_at:o_at +
# 16] = for each of a group's 16 rows, the sum over n_blocks weight blocks of the block's integer products times scale *
# xd (+ bias * xsum). codes: the group's bytes from codes[c_at] (quants.group_rows: per element pair the 16 rows');
# xp: the token's int16 code pairs (int32) from xp[x_at]; xd: its scale per 32-block from xd[d_at]; scale, bias:
# float32 or float16 bits (uint16), per block the 16 rows' from scale[s_at] / bias[b_at]; xsum: the token's float sum
# over each weight block from xsum[t_at]. Kinds q4 (nibbles, 32-blocks), q8 (int8, 32-blocks), q8_16 (int8,
# 16-blocks); _bias: with the bias terms. Where the CPU has no AVX-512 VNNI, the generic IR (the same bits).
group_q4, group_q4_bias, group_q8, group_q8_bias, group_q8_16, group_q8_16_bias = (
    _group_intrinsic(k, b, NATIVE_VNNI) for k in ("q4", "q8", "q8_16") for b in (False, True))
(group_q4_generic, group_q4_bias_generic, group_q8_generic, group_q8_bias_generic, group_q8_16_generic,
 group_q8_16_bias_generic) = (_group_intrinsic(k, b, False) for k in ("q4", "q8", "q8_16") for b in (False, True))
