"""The TPU cost model against bytes and flops counted by hand, on small kernels and on the anchors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_hub import verify
from pallas_hub.bench import costmodel
from pallas_hub.vendored import _chips as chips


# --------------------------------------------------------------------------- small kernels

def _matmul(x, y, *, bm, bn, bk):
    m, k = x.shape
    n = y.shape[1]

    def kernel(x_ref, y_ref, o_ref, acc_ref):
        @pl.when(pl.program_id(2) == 0)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

        @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
        def _():
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)

    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, bm), pl.cdiv(n, bn), pl.cdiv(k, bk)),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                  pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
    )(x, y)


@pytest.mark.parametrize("m,k,n,bm,bk,bn", [
    (256, 512, 384, 128, 128, 128),  # K split: x re-fetched every step
    (256, 128, 384, 128, 128, 128),  # one K block: x fetched once per row of blocks
    (200, 128, 300, 128, 128, 128),  # edge blocks: full padded blocks move
])
def test_matmul_bytes_and_flops_by_hand(m, k, n, bm, bk, bn):
    x = jnp.ones((m, k), jnp.bfloat16)
    y = jnp.ones((k, n), jnp.bfloat16)
    cost = costmodel.estimate(functools.partial(_matmul, bm=bm, bn=bn, bk=bk), x, y)
    gm, gn, gk = -(-m // bm), -(-n // bn), -(-k // bk)
    steps = gm * gn * gk
    x_moves = steps if gk > 1 else gm  # index (i, kk): constant over j only when there is one K block
    y_moves = steps if gk > 1 or gn > 1 else 1
    assert cost.grid_steps == steps
    assert cost.hbm_read_bytes == x_moves * bm * bk * 2 + y_moves * bk * bn * 2
    assert cost.hbm_write_bytes == gm * gn * bm * bn * 4
    assert cost.flops == steps * 2 * bm * bn * bk
    assert len(cost.calls) == 1


def _gather_rows(rows, x, *, skip_from):
    """out[i] = x[rows[i]] (8-row blocks); steps i >= skip_from do their dot only under pl.when."""
    n_out = rows.shape[0]

    def kernel(rows_ref, x_ref, w_ref, o_ref):
        @pl.when(pl.program_id(0) < skip_from)
        def _():
            o_ref[...] = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)

        @pl.when(pl.program_id(0) >= skip_from)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

    w = jnp.eye(128, dtype=jnp.float32)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(n_out,),
            in_specs=[pl.BlockSpec((8, 128), lambda i, r: (r[i], 0)),
                      pl.BlockSpec((128, 128), lambda i, r: (0, 0))],
            out_specs=pl.BlockSpec((8, 128), lambda i, r: (i, 0))),
        out_shape=jax.ShapeDtypeStruct((n_out * 8, 128), jnp.float32),
    )(rows, x, w)


def test_scalar_prefetch_index_maps_and_guarded_dots():
    rows = jnp.array([0, 0, 3, 3, 3, 1, 0, 0], jnp.int32)  # runs: 0 | 3 | 1 | 0 -> 4 fetches
    x = jnp.ones((32, 128), jnp.float32)
    cost = costmodel.estimate(functools.partial(_gather_rows, skip_from=5), rows, x)
    (call,) = cost.calls
    assert [o.moves for o in call.operands if o.kind == "input"] == [4, 1]
    assert cost.hbm_read_bytes == 4 * 8 * 128 * 4 + 128 * 128 * 4 + rows.size * 4
    assert cost.hbm_write_bytes == 8 * 8 * 128 * 4
    assert cost.flops == 5 * 2 * 8 * 128 * 128  # only the five steps where pl.when holds


def _copies_call(kernel, buf_rows, n_chunks, x):
    """``kernel(n_ref, x_hbm, o_ref, buf, sem)`` in one grid step: x left in HBM, a [16, 128] f32 output
    block, a [buf_rows, 128] f32 VMEM buffer and a DMA semaphore."""
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(1,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((16, 128), lambda i, n: (0, 0)),
            scratch_shapes=[pltpu.VMEM((buf_rows, 128), jnp.float32), pltpu.SemaphoreType.DMA]),
        out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
    )(n_chunks, x)


def _manual_copies(n_chunks, x):
    """Copies the first n_chunks[0] chunks of 16 rows from HBM with make_async_copy, one by one."""

    def kernel(n_ref, x_hbm, o_ref, buf, sem):
        def body(c, carry):
            copy = pltpu.make_async_copy(x_hbm.at[pl.ds(c * 16, 16)], buf, sem)
            copy.start()
            copy.wait()
            o_ref[...] += buf[...]
            return carry

        o_ref[...] = jnp.zeros_like(o_ref)
        jax.lax.fori_loop(0, n_ref[0], body, 0)

    return _copies_call(kernel, 16, n_chunks, x)


@pytest.mark.parametrize("n", [0, 3, 7])
def test_manual_dmas_counted_as_issued(n):
    x = jnp.ones((128, 128), jnp.float32)
    cost = costmodel.estimate(_manual_copies, jnp.array([n], jnp.int32), x)
    (call,) = cost.calls
    assert call.dma_read_bytes == n * 16 * 128 * 4
    assert call.dma_write_bytes == 0
    assert call.pipeline_steps == n  # each copy loop iteration is a step
    assert cost.hbm_read_bytes == n * 16 * 128 * 4 + 4  # + the scalar-prefetch operand
    assert cost.hbm_write_bytes == 16 * 128 * 4


def test_time_and_roofline_arithmetic():
    x = jnp.ones((256, 512), jnp.bfloat16)
    y = jnp.ones((512, 384), jnp.bfloat16)
    cost = costmodel.estimate(functools.partial(_matmul, bm=128, bn=128, bk=128), x, y)
    for name in chips.DEFAULT_CHIPS:
        c = chips.chip(name)
        expect = max(cost.hbm_bytes / c.hbm_bandwidth, cost.flops / c.peak_flops) + cost.grid_steps * c.step_overhead_s
        assert cost.time(name) == pytest.approx(expect)
        min_bytes = x.size * 2 + y.size * 2 + 256 * 384 * 4
        min_flops = 2 * 256 * 512 * 384
        frac = costmodel.roofline_fraction(cost, min_bytes, min_flops, name)
        assert 0 < frac < 1
        assert frac == pytest.approx(costmodel.ideal_time(min_bytes, min_flops, name) / expect)


def test_no_pallas_call_is_an_error():
    with pytest.raises(ValueError, match="no pallas_call"):
        costmodel.estimate(lambda a: a + 1, jnp.ones((8, 128)))


def test_two_calls_are_summed_and_outputs_flow_on():
    x = jnp.ones((128, 128), jnp.bfloat16)

    def two(a):
        h = _matmul(a, a, bm=128, bn=128, bk=128)
        return _matmul(h.astype(jnp.bfloat16), a, bm=128, bn=128, bk=128)

    cost = costmodel.estimate(two, x)
    assert len(cost.calls) == 2
    assert cost.flops == 2 * 2 * 128 ** 3
    assert cost.time("v6e") == pytest.approx(sum(c.time("v6e") for c in cost.calls))


def test_step_types_add_up_to_the_totals():
    """The per-step records (what the v2 model times) sum to the whole-call counts, per loop level."""
    rows = jnp.array([0, 0, 3, 3, 3, 1, 0, 0], jnp.int32)
    cost = costmodel.estimate(functools.partial(_gather_rows, skip_from=5), rows, jnp.ones((32, 128), jnp.float32))
    (call,) = cost.calls
    assert sum(t.count for t in call.step_types) == 8
    assert sum(t.count * sum(t.flops) for t in call.step_types) == call.flops
    inputs = sum(o.bytes for o in call.operands if o.kind == "input")
    assert sum(t.count * t.read_bytes for t in call.step_types) == inputs
    assert sum(t.count * t.write_bytes for t in call.step_types) == call.hbm_write_bytes
    # the dot ran in steps 0-4: step 0 fetched x and w, step 2 a new x block, steps 1, 3, 4 nothing
    x_block, w_block = 8 * 128 * 4, 128 * 128 * 4
    assert sorted((t.count, t.read_bytes) for t in call.step_types if sum(t.flops) == 2 * 8 * 128 * 128) == \
        [(1, x_block), (1, x_block + w_block), (3, 0)]
    copies = costmodel.estimate(_manual_copies, jnp.array([3], jnp.int32), jnp.ones((128, 128), jnp.float32)).calls[0]
    (loop,) = copies.loops
    assert loop.parent is None and loop.static_trips is None and loop.pipeline
    (step,) = copies.step_types
    assert step.iterations == (3,) and step.dma_read == (0, 3 * 16 * 128 * 4)  # the copies sit in the loop level


def _chunks_started_by_an_inner_loop(n_chunks, x):
    """n_chunks[0] chunks of 32 rows, each started as two 16-row copies by an inner loop that only starts
    them (paged attention's page loop, vLLM TPU's cache-update loop), then waited for and summed."""

    def kernel(n_ref, x_hbm, o_ref, buf, sem):
        def body(c, carry):
            def start(j, carry):
                pltpu.make_async_copy(x_hbm.at[pl.ds(c * 32 + j * 16, 16)], buf.at[pl.ds(j * 16, 16)], sem).start()
                return carry
            jax.lax.fori_loop(0, 2, start, 0)
            pltpu.make_async_copy(buf, buf, sem).wait()
            o_ref[...] += buf[pl.ds(0, 16)] + buf[pl.ds(16, 16)]
            return carry

        o_ref[...] = jnp.zeros_like(o_ref)
        jax.lax.fori_loop(0, n_ref[0], body, 0)

    return _copies_call(kernel, 32, n_chunks, x)


def test_a_loop_that_only_starts_copies_is_work_of_the_step_that_waits():
    """A DMA-loop step is an iteration of the loop that starts copies and waits for them (a software
    pipeline's step), not of an inner loop that only starts them: its iterations are issue work inside
    that step, with no per-step cost of their own."""
    x = jnp.arange(96 * 128, dtype=jnp.float32).reshape(96, 128)
    n = jnp.array([3], jnp.int32)
    with verify.interpret("fast"):
        got = _chunks_started_by_an_inner_loop(n, x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(x.reshape(6, 16, 128).sum(0)))
    (call,) = costmodel.estimate(_chunks_started_by_an_inner_loop, n, x).calls
    chunks, starts = call.loops
    assert chunks.parent is None and chunks.pipeline
    assert starts.parent == 0 and starts.static_trips == 2 and not starts.pipeline
    assert call.pipeline_steps == 3  # the chunks, not the 6 copies
    (step,) = call.step_types
    assert step.iterations == (3, 6) and step.dma_read == (0, 0, 6 * 16 * 128 * 4)


def _table_row_copies(lengths, table, pages):
    """Each step copies its row of a page table from HBM into SMEM, then copies that many pages."""

    def kernel(len_ref, table_hbm, pages_hbm, o_ref, row_smem, buf, sem):
        s = pl.program_id(0)
        pltpu.make_async_copy(table_hbm.at[s], row_smem, sem).start()
        pltpu.make_async_copy(table_hbm.at[s], row_smem, sem).wait()

        def body(j, carry):
            copy = pltpu.make_async_copy(pages_hbm.at[row_smem[j]], buf, sem)
            copy.start()
            copy.wait()
            return carry + row_smem[j]  # the page ids steer nothing but are read as values

        o_ref[...] = jnp.zeros_like(o_ref)
        jax.lax.fori_loop(0, len_ref[s], body, 0)

    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(lengths.shape[0],),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((8, 128), lambda i, n: (0, 0)),
            scratch_shapes=[pltpu.SMEM((table.shape[1],), jnp.int32), pltpu.VMEM((8, 128), jnp.float32),
                            pltpu.SemaphoreType.DMA]),
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
    )(lengths, table, pages)


def test_a_dma_into_smem_carries_the_values_of_a_concrete_table():
    lengths = jnp.array([2, 0, 3], jnp.int32)
    table = jnp.array([[4, 1, 0], [2, 2, 2], [3, 0, 1]], jnp.int32)
    pages = jax.ShapeDtypeStruct((5, 8, 128), jnp.float32)
    (call,) = costmodel.estimate(_table_row_copies, lengths, table, pages).calls
    row = table.shape[1] * 4
    assert call.dma_read_bytes == 3 * row + 5 * 8 * 128 * 4  # three table rows, five pages
    with pytest.raises(costmodel.CostModelError, match="does not know"):  # a table that is only a shape
        costmodel.estimate(_table_row_copies, lengths, jax.ShapeDtypeStruct(table.shape, table.dtype), pages)


def test_copies_through_reshape_and_bitcast_count_their_bytes():
    def kernel(n_ref, x_hbm, o_ref, buf, sem):
        view = x_hbm.bitcast(jnp.uint32).reshape(8, 16, 128)  # [16, 16, 128] bf16 -> [8, 16, 128] u32
        copy = pltpu.make_async_copy(view.at[pl.ds(0, n_ref[0])], buf.at[pl.ds(0, n_ref[0])], sem)
        copy.start()
        copy.wait()
        o_ref[...] = jnp.zeros_like(o_ref)

    def f(n, x):
        return pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1, grid=(1,), in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                out_specs=pl.BlockSpec((8, 128), lambda i, n: (0, 0)),
                scratch_shapes=[pltpu.VMEM((8, 16, 128), jnp.uint32), pltpu.SemaphoreType.DMA]),
            out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32))(n, x)

    (call,) = costmodel.estimate(f, jnp.array([3], jnp.int32), jax.ShapeDtypeStruct((16, 16, 128), jnp.bfloat16)).calls
    assert call.dma_read_bytes == 3 * 16 * 128 * 4


# --------------------------------------------------------------------------- anchors (kernels we did not write)

def _megablox(lhs, rhs, sizes):
    from pallas_hub.bench import anchors

    return anchors.megablox()(lhs, rhs, sizes)


def _tokamax(lhs, rhs, sizes):
    from pallas_hub.bench import anchors

    with anchors.tpu_info_on_cpu("v6e"):  # tokamax asks the TPU for its properties while tracing
        return anchors.tokamax()(lhs, rhs, sizes)


def _jax_paged(q, k_pages, v_pages, lengths, page_indices):
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    return paged_attention(q, k_pages, v_pages, lengths, page_indices, pages_per_compute_block=8)


def test_megablox_gmm_hand_count():
    from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

    m, k, n = 512, 256, 256
    lhs = jnp.ones((m, k), jnp.bfloat16)
    rhs = jnp.ones((4, k, n), jnp.bfloat16)
    sizes = jnp.array([100, 0, 200, 150], jnp.int32)
    cost = costmodel.estimate(megablox.gmm, lhs, rhs, sizes)
    (call,) = cost.calls
    # m tiles visited per group: g0 rows 0-99 -> {0}; g2 rows 100-299 -> {0,1,2}; g3 rows 300-449 -> {2,3}
    assert call.grid == (2, 6, 2)
    lhs_t, rhs_t, out_t = (o for o in call.operands if o.kind in ("input", "output"))
    assert (lhs_t.moves, rhs_t.moves) == (24, 24)  # every step changes (tile, k) and (group, k, n)
    assert out_t.moves == 2 * 4  # four distinct m tiles per n tile, written once each
    assert out_t.block_bytes == 128 * 128 * 4
    assert call.flops == 24 * 2 * 128 ** 3  # megablox runs the dot on every step (masked rows)


def test_flash_attention_causal_skips_blocks():
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    q = jnp.ones((1, 2, 256, 128), jnp.float32)
    cost = costmodel.estimate(functools.partial(fa.flash_attention, causal=True), q, q, q)
    # 2 heads x 3 of 4 (q, kv) block pairs on or below the diagonal x 2 dots of 128^3
    assert cost.flops == 2 * 3 * 2 * 2 * 128 ** 3
    full = costmodel.estimate(functools.partial(fa.flash_attention, causal=False), q, q, q)
    assert full.flops == 2 * 4 * 2 * 2 * 128 ** 3


def test_paged_attention_counts_page_copies():
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    q = jnp.ones((2, 8, 128), jnp.bfloat16)
    pages = jnp.ones((2, 64, 16, 128), jnp.bfloat16)  # 2 kv heads, 64 pages of 16 tokens
    lengths = jnp.array([100, 57], jnp.int32)
    table = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
    cost = costmodel.estimate(functools.partial(paged_attention, pages_per_compute_block=4),
                              q, pages, pages, lengths, table)
    # compute blocks of 4 pages: 100 tokens -> 2 blocks, 57 -> 1 block; K and V, 2 kv heads
    page_bytes = 16 * 128 * 2
    assert cost.calls[0].dma_read_bytes == (2 + 1) * 4 * 2 * 2 * page_bytes


def test_bulk_data_may_be_abstract_but_steering_values_not():
    from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

    sizes = jnp.array([100, 0, 200, 150], jnp.int32)
    lhs = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((4, 256, 256), jnp.bfloat16)
    concrete = costmodel.estimate(megablox.gmm, jnp.ones(lhs.shape, lhs.dtype), jnp.ones(rhs.shape, rhs.dtype), sizes)
    assert costmodel.estimate(megablox.gmm, lhs, rhs, sizes) == concrete
    with pytest.raises(costmodel.CostModelError, match="abstract"):
        costmodel.estimate(megablox.gmm, lhs, rhs, jax.ShapeDtypeStruct((4,), jnp.int32))


def test_tokamax_emit_pipeline_counts_like_megablox():
    """tokamax runs megablox's pipeline by hand (emit_pipeline + DMAs): same traffic, flops and steps."""
    lhs = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((4, 256, 256), jnp.bfloat16)
    sizes = jnp.array([100, 0, 200, 150], jnp.int32)
    mb = costmodel.estimate(_megablox, lhs, rhs, sizes)
    tk = costmodel.estimate(_tokamax, lhs, rhs, sizes)
    (call,) = tk.calls
    assert call.grid == () and call.pipeline_steps == 24
    assert tk.flops == mb.flops == 24 * 2 * 128 ** 3
    assert call.dma_read_bytes == (24 + 24) * 128 * 128 * 2  # lhs and rhs blocks, every step
    assert call.dma_write_bytes == mb.calls[0].hbm_write_bytes == 8 * 128 * 128 * 2


def test_vmapped_kernel_program_ids_skip_the_batch_axis():
    """splash in GQA form is vmapped over K/V heads; its causal block skipping must still count."""
    from pallas_hub.bench import anchors

    q = jax.ShapeDtypeStruct((1, 2, 256, 128), jnp.float32)
    k = jax.ShapeDtypeStruct((1, 2, 256, 128), jnp.float32)
    cost = costmodel.estimate(functools.partial(anchors.splash_attention, scale=1.0), q, k, k)
    assert cost.calls[0].grid == (2, 1, 2, 2)
    assert cost.flops == 2 * 3 * 2 * 2 * 128 ** 3  # 2 heads x 3 causal block pairs x 2 dots


def test_copies_with_run_time_sizes_count_what_is_issued():
    """tokamax's emit_pipeline copies partial edge blocks (k = 200 = 128 + 72) with run-time sizes."""
    lhs = jax.ShapeDtypeStruct((128, 200), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((2, 200, 128), jnp.bfloat16)
    cost = costmodel.estimate(_tokamax, lhs, rhs, jnp.array([100, 28], jnp.int32))
    (call,) = cost.calls
    assert call.pipeline_steps == 4  # 2 groups in the one m tile x 2 k blocks
    full = 4 * (128 * 128 * 2) * 2  # lhs and rhs blocks, whole, every step
    clipped = 2 * 2 * (128 * 128 + 128 * 72) * 2  # both clipped to the 72 valid columns/rows at the edge
    assert clipped <= call.dma_read_bytes < full


class InterpreterTraffic:
    """Bytes the strict TPU interpreter really copies: its pipeline's block copies (HBM reads tagged
    with an input name, HBM stores of output blocks) and every DMA it executes. Its initial loads of
    output buffers are left out (they are simulator set-up; a TPU does not read output blocks)."""

    def __init__(self, monkeypatch):
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

        self.counts = {"pipeline_read": 0, "pipeline_write": 0, "dma_read": 0, "dma_write": 0}
        hbm = {k for k, v in ipc.TPU_MEMORY_SPACE_NAMES.items() if v in ("hbm", "any")}
        get, store, execute_read = ipc.get, ipc.store, ipc.DMA.execute_read

        def counting_get(*a, **k):
            token, val = get(*a, **k)
            if int(a[3]) in hbm and k.get("input_name"):
                self.counts["pipeline_read"] += val.nbytes
            return token, val

        def counting_store(*a, **k):
            if int(a[3]) in hbm:
                self.counts["pipeline_write"] += np.asarray(a[6]).nbytes
            return store(*a, **k)

        def counting_read(dma):
            execute_read(dma)
            if dma.data is not None:
                if dma.src_memory_space in hbm:
                    self.counts["dma_read"] += dma.data_size
                if dma.dst_memory_space in hbm:
                    self.counts["dma_write"] += dma.data_size

        counting_get.__wrapped__, counting_store.__wrapped__ = get.__wrapped__, store.__wrapped__
        monkeypatch.setattr(ipc, "get", counting_get)
        monkeypatch.setattr(ipc, "store", counting_store)
        monkeypatch.setattr(ipc.DMA, "execute_read", counting_read)

    def run(self, fn, *args):
        with verify.interpret("strict", detect_races=False):
            jax.block_until_ready(jax.jit(fn)(*args))
        return self.counts


def _model_traffic(fn, *args):
    calls = costmodel.estimate(fn, *args).calls
    return {"pipeline_read": sum(o.bytes for c in calls for o in c.operands if o.kind in ("input", "smem")),
            "pipeline_write": sum(o.bytes for c in calls for o in c.operands if o.kind == "output"),
            "dma_read": sum(c.dma_read_bytes for c in calls), "dma_write": sum(c.dma_write_bytes for c in calls)}


@pytest.mark.strict_interpret
def test_model_matches_the_copies_the_strict_interpreter_makes(monkeypatch):
    """Independent check: the TPU simulator's own block copies and DMAs, byte for byte."""
    lhs = jnp.ones((512, 256), jnp.float32)
    rhs = jnp.ones((4, 256, 256), jnp.float32)
    sizes = jnp.array([100, 0, 200, 150], jnp.int32)
    q = jnp.ones((2, 8, 128), jnp.bfloat16)
    pages = jnp.ones((2, 64, 16, 128), jnp.bfloat16)
    paged = (_jax_paged, q, pages, pages, jnp.array([100, 57], jnp.int32), jnp.arange(16, dtype=jnp.int32).reshape(2, 8))
    for fn, *args in [(_megablox, lhs, rhs, sizes), (_tokamax, lhs, rhs, sizes), paged]:
        simulated = InterpreterTraffic(monkeypatch).run(fn, *args)
        assert _model_traffic(fn, *args) == simulated, fn


def _our_kernel_keys():
    from pallas_hub.bench import runner as bench
    from pallas_hub.hub import manifest

    try:
        return list(bench.raced_kernels())
    except manifest.ManifestError:
        return []


@pytest.mark.strict_interpret
@pytest.mark.parametrize("key", _our_kernel_keys())
def test_our_kernels_match_the_strict_interpreter(key, monkeypatch, tmp_path):
    from pallas_hub.bench import runner as bench

    family = bench.raced_kernels()[key][1]
    (impl,) = [i for i in bench.implementations((family,), progress=lambda *_: None) if i.name == f"ours: {key}"]
    assert impl.fn is not None, impl.missing
    problem = next(p for p in bench.problems(families=(family,)))
    check = problem.check()
    fn, args = impl.call(check.kwargs, "v6e"), impl.args(check.args, problem.params)
    assert _model_traffic(fn, *args) == InterpreterTraffic(monkeypatch).run(fn, *args)
