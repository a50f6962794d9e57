"""Attention's scores on the CPU: q against 16 K rows at a time, the slots the lanes, as LLVM IR (a numba intrinsic).

A slot's score is a dot product over head_dim, summed in order; run one slot after another it is a latency-bound
chain, so the decode step takes 16 slots side by side, each in a lane of its own. That needs K's rows transposed:
numba's loop vectorizer leaves the transpose (and the float16 widening of a pool row) scalar, ~1 cycle an element,
more than the products themselves. Here each 16 x 16 block of K (16 slots' rows, 16 of their elements) is loaded as
16 vectors, widened (float16: x86's vcvtph2ps, exact), transposed in registers by four rounds of shuffles, and
multiplied into every q head's 16 scores while it is in registers. The arithmetic is the scalar loop's: per slot,
score = ((0 + q0 k0) + q1 k1) + ... in order over head_dim, a multiply and an add each (no fused multiply-add).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from lucekv.kernels.cpu.intdot import _F32, _I16, _I32, _I64, _counted_loop, _fn, _load, _ptr, _splat, _vec

LANES = 16  # slots a vector, and K elements a block of the transpose


def _transpose(builder, rows):
    """16 vectors of 16 lanes, rows[i][l] = M[i][l] -> cols[j][i] = M[i][j]: the off-diagonal blocks of 8, 4, 2 and 1
    lanes swapped in turn (one two-source shuffle a vector each round)."""
    rows = list(rows)
    for b in (8, 4, 2, 1):
        low = ir.Constant(_vec(_I32, LANES), [lane if lane & b == 0 else LANES + lane - b for lane in range(LANES)])
        high = ir.Constant(_vec(_I32, LANES), [lane + b if lane & b == 0 else LANES + lane for lane in range(LANES)])
        for i in range(LANES):
            if i & b == 0:
                a, c = rows[i], rows[i + b]
                rows[i], rows[i + b] = builder.shuffle_vector(a, c, low), builder.shuffle_vector(a, c, high)
    return rows


PREFETCH_SLOTS = 16  # value_sums: slots ahead whose V rows it asks the cache for (key_scores: the next tile's K rows)


def _prefetch(builder, ptr, at):
    """Ask the cache for the line of ptr[at] (llvm.prefetch: a read, kept in all levels)."""
    i8p = ir.IntType(8).as_pointer()
    fn = _fn(builder, "llvm.prefetch.p0i8", ir.VoidType(), [i8p, _I32, _I32, _I32])
    builder.call(fn, [builder.bitcast(builder.gep(ptr, [at]), i8p), ir.Constant(_I32, 0), ir.Constant(_I32, 3),
                      ir.Constant(_I32, 1)])


def _row_start(context, builder, sig, slots, s_at, s, row_stride, row_at):
    """Where slot s's row starts in the pool (elements)."""
    slot = builder.load(builder.gep(slots, [builder.add(s_at, s)]))
    return builder.add(builder.mul(context.cast(builder, slot, sig.args[1].dtype, types.int64), row_stride), row_at)


def _codegen(context, builder, sig, args):
    pool, slots, q, out = (_ptr(context, builder, sig.args[i], args[i], ir.Constant(_I64, 0)) for i in (0, 1, 6, 10))
    s_at, n, row_stride, row_at, q_at, n_heads, hd, o_at, o_stride = (
        context.cast(builder, args[i], sig.args[i], types.int64) for i in (2, 3, 4, 5, 7, 8, 9, 11, 12))
    halves = sig.args[0].dtype == types.uint16
    v16f = _vec(_F32, LANES)
    one, lanes = ir.Constant(_I64, 1), ir.Constant(_I64, LANES)
    last = builder.sub(n, one)
    n_tiles = builder.sdiv(builder.add(n, ir.Constant(_I64, LANES - 1)), lanes)

    def tile(t, _):
        first = builder.mul(t, lanes)

        def clamped(s):  # lanes past n: the last slot's row again
            return builder.select(builder.icmp_signed("<", s, last), s, last)

        starts = [_row_start(context, builder, sig, slots, s_at, clamped(builder.add(first, ir.Constant(_I64, i))),
                             row_stride, row_at) for i in range(LANES)]
        after = [_row_start(context, builder, sig, slots, s_at, clamped(builder.add(first, ir.Constant(_I64, i))),
                            row_stride, row_at) for i in range(LANES, 2 * LANES)]  # the next tile's rows

        def block(c, _):
            k0 = builder.mul(c, lanes)
            for start in after:
                _prefetch(builder, pool, builder.add(start, k0))
            rows = []
            for start in starts:
                at = builder.add(start, k0)
                if halves:
                    bits = _load(builder, pool, at, _vec(_I16, LANES))
                    rows.append(builder.fpext(builder.bitcast(bits, _vec(ir.HalfType(), LANES)), v16f))
                else:
                    rows.append(_load(builder, pool, at, v16f))
            cols = _transpose(builder, rows)  # cols[j]: element k0 + j of the 16 slots

            def head(h, _):
                at = builder.add(builder.add(o_at, builder.mul(h, o_stride)), first)
                dst = builder.bitcast(builder.gep(out, [at]), v16f.as_pointer())
                zero = ir.Constant(v16f, [0.0] * LANES)
                acc = builder.select(builder.icmp_signed("==", c, ir.Constant(_I64, 0)), zero,
                                     builder.load(dst, align=4))
                qh = builder.add(builder.add(q_at, builder.mul(h, hd)), k0)
                for j, col in enumerate(cols):
                    qj = builder.load(builder.gep(q, [builder.add(qh, ir.Constant(_I64, j))]))
                    acc = builder.fadd(acc, builder.fmul(_splat(builder, qj, LANES), col))
                builder.store(acc, dst, align=4)
                return []

            _counted_loop(builder, n_heads, "kv_tiles.head", head, [])
            return []

        _counted_loop(builder, builder.sdiv(hd, lanes), "kv_tiles.block", block, [])
        return []

    _counted_loop(builder, n_tiles, "kv_tiles.tile", tile, [])
    return context.get_dummy_value()


@intrinsic
def key_scores(typingctx, pool, slots, s_at, n, row_stride, row_at, q, q_at, n_heads, hd, out, o_at, o_stride):
    """out[o_at + h * o_stride + s] = q_h . K row of slot s, for s < n rounded up to 16 (lanes past n: slot n - 1's
    score again) and heads h < n_heads, q_h = q[q_at + h * hd:][:hd]. Slot s's K row is pool[slots[s_at + s] *
    row_stride + row_at:][:hd] (pool flat: float32, or float16 as uint16 bits); hd a multiple of 16."""
    arrays = (pool, slots, q, out)
    if not (all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in arrays)
            and pool.dtype in (types.uint16, types.float32) and isinstance(slots.dtype, types.Integer)
            and q.dtype == types.float32 and out.dtype == types.float32):
        return None
    sig = types.void(pool, slots, s_at, n, row_stride, row_at, q, q_at, n_heads, hd, out, o_at, o_stride)
    return sig, _codegen


CHAINS = 4  # blocks of 16 elements value_sums keeps in flight: independent sums, so not one add latency a slot


def _value_codegen(context, builder, sig, args):
    pool, slots, w, out = (_ptr(context, builder, sig.args[i], args[i], ir.Constant(_I64, 0)) for i in (0, 1, 6, 11))
    s_at, n, row_stride, row_at, w_at, w_stride, n_heads, hd, o_at, o_stride = (
        context.cast(builder, args[i], sig.args[i], types.int64) for i in (2, 3, 4, 5, 7, 8, 9, 10, 12, 13))
    halves = sig.args[0].dtype == types.uint16
    v16f = _vec(_F32, LANES)
    lanes = ir.Constant(_I64, LANES)
    n_blocks = builder.sdiv(hd, lanes)
    whole = builder.sdiv(n_blocks, ir.Constant(_I64, CHAINS))

    def head(h, _):
        ws = builder.add(w_at, builder.mul(h, w_stride))
        oh = builder.add(o_at, builder.mul(h, o_stride))

        def blocks(first, width):
            """The sums of blocks first..first + width (width fixed), over every slot."""
            k0 = builder.mul(first, lanes)

            def slot(s, state):
                ahead = builder.add(s, ir.Constant(_I64, PREFETCH_SLOTS))
                ahead = builder.select(builder.icmp_signed("<", ahead, n), ahead, builder.sub(n, ir.Constant(_I64, 1)))
                ahead_at = builder.add(_row_start(context, builder, sig, slots, s_at, ahead, row_stride, row_at), k0)
                for b in range(width):
                    _prefetch(builder, pool, builder.add(ahead_at, ir.Constant(_I64, b * LANES)))
                e = builder.load(builder.gep(w, [builder.add(ws, s)]))
                visible = builder.fcmp_ordered(">=", e, ir.Constant(_F32, 0.0))
                before = builder.block
                with builder.if_then(visible):
                    index = builder.load(builder.gep(slots, [builder.add(s_at, s)]))
                    start = builder.add(builder.add(builder.mul(context.cast(builder, index, sig.args[1].dtype,
                                                                             types.int64), row_stride), row_at), k0)
                    ev = _splat(builder, e, LANES)
                    added = []
                    for b, acc in enumerate(state):
                        at = builder.add(start, ir.Constant(_I64, b * LANES))
                        if halves:
                            bits = _load(builder, pool, at, _vec(_I16, LANES))
                            v = builder.fpext(builder.bitcast(bits, _vec(ir.HalfType(), LANES)), v16f)
                        else:
                            v = _load(builder, pool, at, v16f)
                        added.append(builder.fadd(acc, builder.fmul(ev, v)))
                    inside = builder.block
                merged = []
                for acc, new in zip(state, added, strict=True):
                    phi = builder.phi(v16f)
                    phi.add_incoming(acc, before)
                    phi.add_incoming(new, inside)
                    merged.append(phi)
                return merged

            accs = _counted_loop(builder, n, f"kv_tiles.slot{width}", slot, [ir.Constant(v16f, [0.0] * LANES)] * width)
            for b, acc in enumerate(accs):
                at = builder.add(builder.add(oh, k0), ir.Constant(_I64, b * LANES))
                builder.store(acc, builder.bitcast(builder.gep(out, [at]), v16f.as_pointer()), align=4)

        chains = ir.Constant(_I64, CHAINS)
        _counted_loop(builder, whole, "kv_tiles.chains", lambda g, _: blocks(builder.mul(g, chains), CHAINS) or [], [])
        _counted_loop(builder, builder.sub(n_blocks, builder.mul(whole, chains)), "kv_tiles.rest",
                      lambda g, _: blocks(builder.add(builder.mul(whole, chains), g), 1) or [], [])
        return []

    _counted_loop(builder, n_heads, "kv_tiles.vhead", head, [])
    return context.get_dummy_value()


@intrinsic
def value_sums(typingctx, pool, slots, s_at, n, row_stride, row_at, w, w_at, w_stride, n_heads, hd, out, o_at,
               o_stride):
    """out[o_at + h * o_stride:][:hd] = the sum over slots s < n, in order, of w_h[s] times V row of slot s, for heads
    h < n_heads, w_h = w[w_at + h * w_stride:]; a slot whose weight is negative (out of view) is left out. Slot s's V
    row is pool[slots[s_at + s] * row_stride + row_at:][:hd] (pool flat: float32, or float16 as uint16 bits); hd a
    multiple of 16. Each sum is the scalar loop's: ((0 + w0 v0) + w1 v1) + ..., a multiply and an add a term."""
    arrays = (pool, slots, w, out)
    if not (all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in arrays)
            and pool.dtype in (types.uint16, types.float32) and isinstance(slots.dtype, types.Integer)
            and w.dtype == types.float32 and out.dtype == types.float32):
        return None
    sig = types.void(pool, slots, s_at, n, row_stride, row_at, w, w_at, w_stride, n_heads, hd, out, o_at, o_stride)
    return sig, _value_codegen


# e^x, 16 lanes at a time (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r, times 2^n; within
# ~1 ulp of the correctly rounded value). x <= 0 here; below -87.3 (e^x under float32's smallest normal) it is taken
# as -87.3: 1.2e-38, nothing beside the e^0 = 1 every softmax sums.
_EXP_LOW, _LOG2E, _LN2_HI, _LN2_LO = -87.33654, 1.44269504088896341, 0.693359375, -2.12194440e-4
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def _exp_codegen(context, builder, sig, args):
    scores = _ptr(context, builder, sig.args[0], args[0], ir.Constant(_I64, 0))
    at, n = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (1, 2))
    v16f, v16i = _vec(_F32, LANES), _vec(_I32, LANES)

    def splat(c):
        return ir.Constant(v16f, [c] * LANES)

    top = _splat(builder, args[3], LANES)
    floor = _fn(builder, "llvm.floor.v16f32", v16f, [v16f])
    maxnum = _fn(builder, "llvm.maxnum.v16f32", v16f, [v16f, v16f])

    def block(b, _):
        ptr = builder.bitcast(builder.gep(scores, [builder.add(at, builder.mul(b, ir.Constant(_I64, LANES)))]),
                              v16f.as_pointer())
        s = builder.load(ptr, align=4)
        x = builder.call(maxnum, [builder.fsub(s, top), splat(_EXP_LOW)])
        k = builder.call(floor, [builder.fadd(builder.fmul(x, splat(_LOG2E)), splat(0.5))])
        r = builder.fsub(builder.fsub(x, builder.fmul(k, splat(_LN2_HI))), builder.fmul(k, splat(_LN2_LO)))
        p = splat(_EXP_POLY[0])
        for c in _EXP_POLY[1:]:
            p = builder.fadd(builder.fmul(p, r), splat(c))
        y = builder.fadd(builder.fadd(builder.fmul(p, builder.fmul(r, r)), r), splat(1.0))
        two_k = builder.bitcast(builder.shl(builder.add(builder.fptosi(k, v16i), ir.Constant(v16i, [127] * LANES)),
                                            ir.Constant(v16i, [23] * LANES)), v16f)
        visible = builder.fcmp_ordered("one", s, splat(float("-inf")))
        builder.store(builder.select(visible, builder.fmul(y, two_k), splat(-1.0)), ptr, align=4)
        return []

    _counted_loop(builder, builder.sdiv(builder.add(n, ir.Constant(_I64, LANES - 1)), ir.Constant(_I64, LANES)),
                  "kv_tiles.exp", block, [])
    return context.get_dummy_value()


@intrinsic
def exp_weights(typingctx, scores, at, n, top):
    """scores[at + s] = e^(scores[at + s] - top) (see _EXP_POLY), or -1 where it is -inf (out of view), for s < n
    rounded up to 16 (the lanes past n are computed too: scores must hold them)."""
    if not (isinstance(scores, types.Array) and scores.ndim == 1 and scores.layout == "C"
            and scores.dtype == types.float32 and top == types.float32):
        return None
    return types.void(scores, at, n, top), _exp_codegen
