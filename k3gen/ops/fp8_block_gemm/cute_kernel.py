"""fp8_block_gemm for sm_100a / sm_103a / sm_107a in CuTe DSL: tcgen05.mma with the accumulator in
TMEM. The contract is `spec.py`'s; the design (swap-AB, warp roles, the cp.async "tcgen05" and the TMA
"tcgen05_tma" loads, split-K through DSMEM, the UE8M0 and FP32 recipes, edges) is in TCGEN05.md.
Constants and the DSMEM load helper live in cute_parts.py (hashed with this module).

Importing this module imports cutlass; only the compile worker (k3gen.pipeline.cute) does.
"""
from __future__ import annotations

import os

import cuda.bindings.driver as cuda_drv
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as bs_layout
from cutlass import Float32, Int32, Uint8, Uint32
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.cute.runtime import make_fake_compact_tensor

from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.fp8_block_gemm.spec import BLOCK, TC_TILE_N, Fp8BlockGemmSpec, k_range
from k3gen.ops.fp8_block_gemm.cute_parts import (E8M0_ONE, EPI_COLS, EPI_WARPS, LOAD_WARPS, MMA_WARP, ROW_CHUNKS,
                                                 SF_TMEM_COLS, SF_VEC, THREADS, TMEM_COLS, _ld_peer_f32,
                                                 tma_geometry)


class Fp8BlockGemmKernel:
    """One compiled variant: N, K, recipe, bm and stages are compile-time constants."""

    def __init__(self, spec: Fp8BlockGemmSpec, arch: str):
        self.n, self.k, self.bm, self.stages = spec.n, spec.k, spec.bm, spec.stages
        self.k_blocks = spec.k_blocks
        self.ue8m0 = spec.recipe is ScaleRecipe.UE8M0
        self.arch = arch
        # sm_107's tcgen05 MMA atoms take K = 64 per instruction (sm_103: 32), built by utils.sm107.
        self.rubin = spec.target.sm >= 107
        self.acc_stages = 1 if self.ue8m0 else 2
        self.lag = max(1, self.stages - 2)
        self.k_tail = self.k % BLOCK != 0
        self.smem_bytes = 0
        # "tcgen05_tma" (sm_103a / sm_107a): operands by TMA, split-K over a cluster (spec.plan).
        self.tma = spec.mma == "tcgen05_tma"

    def tma_params(self) -> list[dict]:
        """The kernel parameters after the five tensors (k3gen.pipeline.cute lays them out), in
        order: W's tensor map, W's coordinate tensor (all static: no parameter), x's map, x's
        coordinate tensor (M). Each map's geometry is read from the atom CuTe built while tracing
        (cute_parts.tma_geometry): the launcher encodes what CuTe's host code would."""
        if not self.tma:
            return []
        w, x = self.tma_atoms       # set by __call__ (cute.compile traces it first)
        m_dim = [{"mode": 0, "width": 32, "symbol": "M"}]
        return [w, {"tensor": "w_codes", "role": "coord", "dyn_shape": []},
                x, {"tensor": "x_codes", "role": "coord", "dyn_shape": m_dim}]

    # -- compile-time setup (needs the MLIR context: called while tracing) -------------------
    def _make_mma(self, n: int):
        e4m3, kmaj, one = cutlass.Float8E4M3FN, tcgen05.OperandMajorMode.K, tcgen05.CtaGroup.ONE
        if self.ue8m0:
            if self.rubin:
                return utils.sm107.make_blockscaled_trivial_tiled_mma(
                    e4m3, e4m3, kmaj, kmaj, cutlass.Float8E8M0FNU, SF_VEC, one, (TC_TILE_N, n, 64))
            return sm100_utils.make_blockscaled_trivial_tiled_mma(
                e4m3, e4m3, kmaj, kmaj, cutlass.Float8E8M0FNU, SF_VEC, one, (TC_TILE_N, n))
        if self.rubin:
            return utils.sm107.make_trivial_tiled_mma(e4m3, e4m3, kmaj, kmaj, Float32, one,
                                                      (TC_TILE_N, n, 64))
        return sm100_utils.make_trivial_tiled_mma(e4m3, e4m3, kmaj, kmaj, Float32, one, (TC_TILE_N, n))

    def _setup(self):
        self.tiled_mma = self._make_mma(self.bm)
        self.mma_tiler = (TC_TILE_N, self.bm, BLOCK)
        kmaj = tcgen05.OperandMajorMode.K
        e4m3 = cutlass.Float8E4M3FN
        # (rows, K, stage) views: the loaders copy into them, the MMA partitions them.
        self.a_layout = sm100_utils.make_smem_layout(kmaj, (TC_TILE_N, BLOCK), e4m3, self.stages)
        self.b_layout = sm100_utils.make_smem_layout(kmaj, (self.bm, BLOCK), e4m3, self.stages)
        if self.ue8m0:
            # SFB covers 128 token rows whatever bm is (the SF TMEM atom is 128 rows).
            self.tiled_mma_sfb = self._make_mma(TC_TILE_N)
            self.mma_tiler_sfb = (TC_TILE_N, TC_TILE_N, BLOCK)
            self.sfa_layout = bs_layout.make_smem_layout_sfa(self.tiled_mma, self.mma_tiler, SF_VEC,
                                                             self.stages)
            self.sfb_layout = bs_layout.make_smem_layout_sfb(self.tiled_mma_sfb, self.mma_tiler_sfb,
                                                             SF_VEC, self.stages)
            # The same tile as a plain (row, k) -> byte map, for the loaders' scale writes.
            self.sf_fill = cute.tile_to_shape(bs_layout.BlockScaledBasicChunk(SF_VEC).layout,
                                              (TC_TILE_N, BLOCK), (2, 1))
            self.sf_stage_bytes = cute.cosize(cute.filter_zeros(self.sf_fill))
        else:
            self.sf_stage_bytes = 0

    @cute.jit
    def __call__(self, mX: cute.Tensor, mXs: cute.Tensor, mW: cute.Tensor, mWs: cute.Tensor,
                 mOut: cute.Tensor, stream: cuda_drv.CUstream):
        # Traced only to compile; k3gen launches the cubin itself with the spec's grid.
        self._setup()
        stages, acc_stages = self.stages, self.acc_stages
        sf_bytes = max(self.sf_stage_bytes * stages, 16)
        xs_floats = 4 if self.ue8m0 else self.bm * self.k_blocks

        @cute.struct
        class SharedStorage:
            ab_full: cute.struct.MemRange[cutlass.Int64, stages]
            ab_empty: cute.struct.MemRange[cutlass.Int64, stages]
            acc_full: cute.struct.MemRange[cutlass.Int64, acc_stages]
            acc_empty: cute.struct.MemRange[cutlass.Int64, acc_stages]
            tmem_holding: Int32
            sA: cute.struct.Align[cute.struct.MemRange[cutlass.Float8E4M3FN,
                                                       cute.cosize(self.a_layout.outer)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[cutlass.Float8E4M3FN,
                                                       cute.cosize(self.b_layout.outer)], 1024]
            sSFA: cute.struct.Align[cute.struct.MemRange[Uint8, sf_bytes], 128]
            sSFB: cute.struct.Align[cute.struct.MemRange[Uint8, sf_bytes], 128]
            sXs: cute.struct.Align[cute.struct.MemRange[Float32, xs_floats], 16]
            sWs: cute.struct.Align[cute.struct.MemRange[Float32, self.k_blocks], 16]

        @cute.struct
        class TmaStorage:
            ab_full: cute.struct.MemRange[cutlass.Int64, stages]
            ab_empty: cute.struct.MemRange[cutlass.Int64, stages]
            sf_full: cute.struct.MemRange[cutlass.Int64, stages]
            sf_empty: cute.struct.MemRange[cutlass.Int64, stages]
            acc_full: cute.struct.MemRange[cutlass.Int64, acc_stages]
            acc_empty: cute.struct.MemRange[cutlass.Int64, acc_stages]
            tmem_holding: Int32
            sA: cute.struct.Align[cute.struct.MemRange[cutlass.Float8E4M3FN,
                                                       cute.cosize(self.a_layout.outer)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[cutlass.Float8E4M3FN,
                                                       cute.cosize(self.b_layout.outer)], 1024]
            sSFA: cute.struct.Align[cute.struct.MemRange[Uint8, sf_bytes], 128]
            sSFB: cute.struct.Align[cute.struct.MemRange[Uint8, sf_bytes], 128]
            sXs: cute.struct.Align[cute.struct.MemRange[Float32, xs_floats], 16]
            sWs: cute.struct.Align[cute.struct.MemRange[Float32, self.k_blocks], 16]

        self.shared_storage = TmaStorage if self.tma else SharedStorage
        self.smem_bytes = self.shared_storage.size_in_bytes()
        m = mX.shape[0]
        grid = (1, (m + self.bm - 1) // self.bm, (self.n + TC_TILE_N - 1) // TC_TILE_N)
        if cutlass.const_expr(self.tma):
            op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
            # One 128-column K block of 128 weight rows / bm token rows per box, into the stage's
            # 128B-swizzled K-major tile (the layout the MMA descriptors read).
            sw, sx = cute.slice_(self.a_layout, (None, None, 0)), cute.slice_(self.b_layout, (None, None, 0))
            tma_w, gW = cpasync.make_tiled_tma_atom(op, mW, sw, (TC_TILE_N, BLOCK))
            tma_x, gX = cpasync.make_tiled_tma_atom(op, mX, sx, (self.bm, BLOCK))
            self.tma_atoms = [tma_geometry(name, str(a._trait.value.type), str(lay))
                              for name, a, lay in (("w_codes", tma_w, sw), ("x_codes", tma_x, sx))]
            self.kernel_tma(mX, mXs, mW, mWs, mOut, tma_w, gW, tma_x, gX).launch(
                grid=grid, block=[THREADS, 1, 1], smem=self.smem_bytes, stream=stream)
        else:
            self.kernel(mX, mXs, mW, mWs, mOut).launch(
                grid=grid, block=[THREADS, 1, 1], smem=self.smem_bytes, stream=stream)

    # -- the kernel ---------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mX: cute.Tensor, mXs: cute.Tensor, mW: cute.Tensor, mWs: cute.Tensor,
               mOut: cute.Tensor):
        # Layouts and the MMA are rebuilt here: values made while tracing the host function
        # cannot be used inside the kernel's IR.
        self._setup()
        tiled_mma = self.tiled_mma
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        _, by, bz = cute.arch.block_idx()
        m = mX.shape[0]
        n0 = bz * TC_TILE_N
        m0 = by * self.bm
        nb = bz                                # the N tile is exactly one 128-row scale block
        kb_begin = Int32(0)
        n_kb = Int32(self.k_blocks)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        ab_pipe = pipeline.PipelineAsyncUmma.create(
            barrier_storage=storage.ab_full.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * len(LOAD_WARPS)),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
        acc_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_full.data_ptr(), num_stages=self.acc_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * len(EPI_WARPS)),
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
        tmem_bar = pipeline.NamedBarrier(barrier_id=1, num_threads=32 * (len(EPI_WARPS) + 1))
        epi_bar = pipeline.NamedBarrier(barrier_id=2, num_threads=32 * len(EPI_WARPS))
        tmem = utils.TmemAllocator(storage.tmem_holding, barrier_for_retrieve=tmem_bar,
                                   allocator_warp_id=EPI_WARPS[0], arch=self.arch[:6])
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()

        sA = storage.sA.get_tensor(self.a_layout.outer, swizzle=self.a_layout.inner)
        sB = storage.sB.get_tensor(self.b_layout.outer, swizzle=self.b_layout.inner)
        thr_mma = tiled_mma.get_slice(0)
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        tCtAcc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, self.acc_stages))

        if warp < len(LOAD_WARPS):
            self._load(ab_pipe, storage, sA, sB, mX, mXs, mW, mWs, tidx, m, m0, n0, nb,
                       kb_begin, n_kb)
        if warp == MMA_WARP:
            self._mma(tiled_mma, thr_mma, ab_pipe, acc_pipe, tmem, storage, sA, sB, tCtAcc_fake,
                      n_kb)
        if warp >= EPI_WARPS[0] and warp <= EPI_WARPS[-1]:
            self._epilogue(acc_pipe, tmem, epi_bar, storage, tCtAcc_fake, mXs, mWs, mOut,
                           tidx - 32 * EPI_WARPS[0], m, m0, n0, nb, kb_begin, n_kb)

    # -- the TMA kernel (sm_103a / sm_107a): split-K over a cluster --------------------------------
    @cute.kernel
    def kernel_tma(self, mX: cute.Tensor, mXs: cute.Tensor, mW: cute.Tensor, mWs: cute.Tensor,
                   mOut: cute.Tensor, tma_w: cute.CopyAtom, gW: cute.Tensor, tma_x: cute.CopyAtom,
                   gX: cute.Tensor):
        self._setup()
        tiled_mma = self.tiled_mma
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, bz = cute.arch.block_idx()
        split, _, _ = cute.arch.grid_dim()
        m = mX.shape[0]
        n0 = bz * TC_TILE_N
        m0 = by * self.bm
        nb = bz
        # The wgmma kernel's split: rank r of `split` owns K blocks [r KB / split, (r + 1) KB / split).
        kb_begin, n_kb = k_range(bx, split, self.k_blocks)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        one = cute.make_layout((1, 1, 1, 1))
        ab_pipe = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_full.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            tx_count=(TC_TILE_N + self.bm) * BLOCK, cta_layout_vmnk=one, defer_sync=True)
        sf_pipe = None
        if cutlass.const_expr(self.ue8m0):
            # The scale tiles are expanded by the four loader warps (a TMA box cannot repeat a
            # scale over 128 rows), so they have their own ring, in step with the TMA one.
            sf_pipe = pipeline.PipelineAsyncUmma.create(
                barrier_storage=storage.sf_full.data_ptr(), num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * len(LOAD_WARPS)),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                cta_layout_vmnk=one, defer_sync=True)
        acc_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_full.data_ptr(), num_stages=self.acc_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * len(EPI_WARPS)),
            cta_layout_vmnk=one, defer_sync=True)
        tmem_bar = pipeline.NamedBarrier(barrier_id=1, num_threads=32 * (len(EPI_WARPS) + 1))
        epi_bar = pipeline.NamedBarrier(barrier_id=2, num_threads=32 * len(EPI_WARPS))
        tmem = utils.TmemAllocator(storage.tmem_holding, barrier_for_retrieve=tmem_bar,
                                   allocator_warp_id=EPI_WARPS[0], arch=self.arch[:6])
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()

        sA = storage.sA.get_tensor(self.a_layout.outer, swizzle=self.a_layout.inner)
        sB = storage.sB.get_tensor(self.b_layout.outer, swizzle=self.b_layout.inner)
        # After the last MMA the W ring is free: it holds this CTA's FP32 partial for the sum.
        red = cute.make_tensor(cute.recast_ptr(storage.sA.data_ptr(), dtype=Float32),
                               cute.make_layout(TC_TILE_N * self.bm))
        thr_mma = tiled_mma.get_slice(0)
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        tCtAcc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, self.acc_stages))

        if warp < len(LOAD_WARPS):
            self._load_tma(ab_pipe, sf_pipe, storage, sA, sB, thr_mma, tma_w, gW, tma_x, gX, mXs, mWs,
                           tidx, warp, m, m0, nb, by, kb_begin, n_kb)
        if warp == MMA_WARP:
            self._mma(tiled_mma, thr_mma, ab_pipe, acc_pipe, tmem, storage, sA, sB, tCtAcc_fake,
                      n_kb, sf_pipe)
        if warp >= EPI_WARPS[0] and warp <= EPI_WARPS[-1]:
            self._epilogue(acc_pipe, tmem, epi_bar, storage, tCtAcc_fake, mXs, mWs, mOut,
                           tidx - 32 * EPI_WARPS[0], m, m0, n0, nb, kb_begin, n_kb, split, red)
        if split > 1:
            # The wgmma kernel's combine: every partial is in its CTA's shared memory past the
            # first cluster barrier; CTA r sums elements r T, r T + split T, ... over ranks 0..split-1
            # in rank order (the same sum on every run) and the second barrier keeps each CTA's
            # shared memory alive while peers read it.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            mt = cutlass.min(m - m0, self.bm)
            for it in cutlass.range(bx * THREADS + tidx, mt * TC_TILE_N, split * THREADS, unroll=1):
                mm = it // TC_TILE_N
                r = it - mm * TC_TILE_N
                if n0 + r < self.n:
                    v = Float32(0.0)
                    for q in cutlass.range(split, unroll=1):
                        v = v + _ld_peer_f32((red.iterator + it).toint(), q)
                    mOut[m0 + mm, n0 + r] = v.to(cutlass.BFloat16)
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.jit
    def _load_tma(self, ab_pipe, sf_pipe, storage, sA, sB, thr_mma, tma_w, gW, tma_x, gX, mXs, mWs,
                  tid, warp, m, m0, nb, m_tile, kb_begin, n_kb):
        # TMA zero-fills rows past N, tokens past M and columns past K (no E4M3 NaN from stale
        # shared memory), and always counts the whole box: tx_count is the full stage.
        tWs, tWg = cpasync.tma_partition(
            tma_w, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2),
            cute.group_modes(cute.local_tile(gW, (TC_TILE_N, BLOCK), (None, None)), 0, 2))  # (TMA, NT, KB)
        tXs, tXg = cpasync.tma_partition(
            tma_x, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2),
            cute.group_modes(cute.local_tile(gX, (self.bm, BLOCK), (None, None)), 0, 2))    # (TMA, MT, KB)
        if warp == LOAD_WARPS[0]:
            cpasync.prefetch_descriptor(tma_w)
            cpasync.prefetch_descriptor(tma_x)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for i in cutlass.range(n_kb, unroll=1):
            kb = kb_begin + i
            s = state.index
            if warp == LOAD_WARPS[0]:
                ab_pipe.producer_acquire(state)
                bar = ab_pipe.producer_get_barrier(state)
                cute.copy(tma_w, tWg[(None, nb, kb)], tWs[(None, s)], tma_bar_ptr=bar)
                cute.copy(tma_x, tXg[(None, m_tile, kb)], tXs[(None, s)], tma_bar_ptr=bar)
            if cutlass.const_expr(self.ue8m0):
                sf_pipe.producer_acquire(state)
                w_sf = Uint32(mWs[nb, kb]) * Uint32(0x01010101)
                x_b = Uint32(E8M0_ONE)
                tok = m0 + tid
                if tok < m:
                    x_b = Uint32(mXs[tok, kb])
                off = s * self.sf_stage_bytes + self.sf_fill((tid, 0))
                pa = cute.recast_ptr(storage.sSFA.data_ptr() + off, dtype=Uint32)
                pb = cute.recast_ptr(storage.sSFB.data_ptr() + off, dtype=Uint32)
                cute.make_tensor(pa, cute.make_layout(1))[0] = w_sf
                cute.make_tensor(pb, cute.make_layout(1))[0] = x_b * Uint32(0x01010101)
                cute.arch.fence_view_async_shared()
                sf_pipe.producer_commit(state)
            state.advance()
        if warp == LOAD_WARPS[0]:
            ab_pipe.producer_tail(state)

    # -- loaders: cp.async W/x tiles (+ UE8M0 scale tiles) into the stage ---------------------
    @cute.jit
    def _load(self, ab_pipe, storage, sA, sB, mX, mXs, mW, mWs, tid, m, m0, n0, nb, kb_begin, n_kb):
        e4m3 = cutlass.Float8E4M3FN
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                   e4m3, num_bits_per_copy=128)
        rows_per_pass = 32 * len(LOAD_WARPS) // ROW_CHUNKS
        tiled = cute.make_tiled_copy_tv(
            atom, cute.make_layout((rows_per_pass, ROW_CHUNKS), stride=(ROW_CHUNKS, 1)),
            cute.make_layout((1, 16)))
        thr = tiled.get_slice(tid)
        gW = cute.local_tile(mW, (TC_TILE_N, BLOCK), (None, None))      # (128, 128, NT, KB)
        gX = cute.local_tile(mX, (self.bm, BLOCK), (None, None))        # (bm, 128, MT, KB)
        cW = cute.local_tile(cute.make_identity_tensor(mW.shape), (TC_TILE_N, BLOCK), (None, None))
        cX = cute.local_tile(cute.make_identity_tensor(mX.shape), (self.bm, BLOCK), (None, None))
        tWg, tWs, tWc = thr.partition_S(gW), thr.partition_D(sA), thr.partition_S(cW)
        tXg, tXs, tXc = thr.partition_S(gX), thr.partition_D(sB), thr.partition_S(cX)
        n_tile = n0 // TC_TILE_N
        m_tile = m0 // self.bm
        zero = cute.make_rmem_tensor(cute.make_layout((1, 16)), e4m3)
        zero.fill(0.0)

        w_sf = Uint32(0)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        arrive = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for i in cutlass.range(n_kb, unroll=1):
            kb = kb_begin + i
            ab_pipe.producer_acquire(state)
            s = state.index
            for r in cutlass.range_constexpr(cute.size(tWs, mode=[1])):
                crd = tWc[(0, r, 0, n_tile, kb)]
                if crd[0] < self.n:
                    self._copy_or_zero(atom, tWg[(None, r, 0, n_tile, kb)], tWs[(None, r, 0, s)],
                                       crd[1], zero)
            for r in cutlass.range_constexpr(cute.size(tXs, mode=[1])):
                crd = tXc[(0, r, 0, m_tile, kb)]
                if crd[0] < m:
                    self._copy_or_zero(atom, tXg[(None, r, 0, m_tile, kb)], tXs[(None, r, 0, s)],
                                       crd[1], zero)
            cute.arch.cp_async_commit_group()
            if cutlass.const_expr(self.ue8m0):
                # Row `tid` of both SF tiles: one byte per 32 K, four per 128-column block.
                w_sf = Uint32(mWs[nb, kb]) * Uint32(0x01010101)
                x_b = Uint32(E8M0_ONE)
                tok = m0 + tid
                if tok < m:
                    x_b = Uint32(mXs[tok, kb])
                off = s * self.sf_stage_bytes + self.sf_fill((tid, 0))
                pa = cute.recast_ptr(storage.sSFA.data_ptr() + off, dtype=Uint32)
                pb = cute.recast_ptr(storage.sSFB.data_ptr() + off, dtype=Uint32)
                cute.make_tensor(pa, cute.make_layout(1))[0] = w_sf
                cute.make_tensor(pb, cute.make_layout(1))[0] = x_b * Uint32(0x01010101)
            if i >= self.lag:
                cute.arch.cp_async_wait_group(self.lag)
                cute.arch.fence_view_async_shared()
                ab_pipe.producer_commit(arrive)
                arrive.advance()
            state.advance()
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_view_async_shared()
        for _ in cutlass.range(cutlass.min(n_kb, self.lag), unroll=1):
            ab_pipe.producer_commit(arrive)
            arrive.advance()

    @cute.jit
    def _copy_or_zero(self, atom, src, dst, col, zero):
        if cutlass.const_expr(self.k_tail):
            if col < self.k:
                cute.copy(atom, src, dst)
            else:
                cute.autovec_copy(zero, dst)
        else:
            cute.copy(atom, src, dst)

    # -- MMA warp ------------------------------------------------------------------------------
    @cute.jit
    def _mma(self, tiled_mma, thr_mma, ab_pipe, acc_pipe, tmem, storage, sA, sB, tCtAcc_fake, n_kb,
             sf_pipe=None):
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))   # (MMA, MMA_M, MMA_K, STAGE)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        tmem.wait_for_alloc()
        acc_ptr = tmem.retrieve_ptr(Float32)
        tCtAcc_base = cute.make_tensor(acc_ptr, tCtAcc_fake.layout)
        n_k_inst = cute.size(tCrA, mode=[2])
        ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.acc_stages)
        if cutlass.const_expr(self.ue8m0):
            acc_cols = self.bm * self.acc_stages
            sSFA = storage.sSFA.get_tensor(self.sfa_layout)
            sSFB = storage.sSFB.get_tensor(self.sfb_layout)
            sfa_ptr = cute.recast_ptr(acc_ptr + acc_cols, dtype=cutlass.Float8E8M0FNU)
            sfb_ptr = cute.recast_ptr(acc_ptr + acc_cols + SF_TMEM_COLS,
                                      dtype=cutlass.Float8E8M0FNU)
            tCtSFA = cute.make_tensor(sfa_ptr, bs_layout.make_tmem_layout_sfa(
                tiled_mma, self.mma_tiler, SF_VEC, cute.slice_(self.sfa_layout, (None, None, None, 0))))
            tCtSFB = cute.make_tensor(sfb_ptr, bs_layout.make_tmem_layout_sfb(
                tiled_mma, self.mma_tiler, SF_VEC, cute.slice_(self.sfb_layout, (None, None, None, 0))))
            cp_a, sA_s2t, tA_s2t = self._s2t(sSFA, tCtSFA)
            cp_b, sB_s2t, tB_s2t = self._s2t(sSFB, tCtSFB)
            tCtAcc = tCtAcc_base[(None, None, None, 0)]
            acc_pipe.producer_acquire(acc_state)
            tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
            for _ in cutlass.range(n_kb, unroll=1):
                ab_pipe.consumer_wait(ab_state)
                if cutlass.const_expr(sf_pipe is not None):
                    sf_pipe.consumer_wait(ab_state)    # same depth: the two rings move in step
                s = ab_state.index
                cute.copy(cp_a, sA_s2t[(None, None, None, None, s)], tA_s2t)
                cute.copy(cp_b, sB_s2t[(None, None, None, None, s)], tB_s2t)
                for kk in cutlass.range(n_k_inst, unroll_full=True):
                    tiled_mma.set(tcgen05.Field.SFA, tCtSFA[(None, None, kk)].iterator)
                    tiled_mma.set(tcgen05.Field.SFB, tCtSFB[(None, None, kk)].iterator)
                    cute.gemm(tiled_mma, tCtAcc, tCrA[(None, None, kk, s)], tCrB[(None, None, kk, s)],
                              tCtAcc)
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                ab_pipe.consumer_release(ab_state)
                if cutlass.const_expr(sf_pipe is not None):
                    sf_pipe.consumer_release(ab_state)
                ab_state.advance()
            acc_pipe.producer_commit(acc_state)
            acc_state.advance()
        else:
            for _ in cutlass.range(n_kb, unroll=1):
                ab_pipe.consumer_wait(ab_state)
                acc_pipe.producer_acquire(acc_state)
                s = ab_state.index
                tCtAcc = tCtAcc_base[(None, None, None, acc_state.index)]
                tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                for kk in cutlass.range(n_k_inst, unroll_full=True):
                    cute.gemm(tiled_mma, tCtAcc, tCrA[(None, None, kk, s)], tCrB[(None, None, kk, s)],
                              tCtAcc)
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                ab_pipe.consumer_release(ab_state)
                acc_pipe.producer_commit(acc_state)
                ab_state.advance()
                acc_state.advance()
        acc_pipe.producer_tail(acc_state)

    def _s2t(self, sSF, tSF):
        s_compact = cute.filter_zeros(sSF)
        t_compact = cute.filter_zeros(tSF)
        atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE), cutlass.Float8E8M0FNU)
        tiled = tcgen05.make_s2t_copy(atom, t_compact)
        thr = tiled.get_slice(0)
        src = tcgen05.get_s2t_smem_desc_tensor(tiled, thr.partition_S(s_compact))
        return tiled, src, thr.partition_D(t_compact)

    # -- epilogue warps: TMEM -> registers (-> FP32 promotion) -> BF16 out ------------------------
    @cute.jit
    def _epilogue(self, acc_pipe, tmem, epi_bar, storage, tCtAcc_fake, mXs, mWs, mOut, etid, m, m0,
                  n0, nb, kb_begin, n_kb, split=None, red=None):
        sXs = storage.sXs.get_tensor(cute.make_layout(self.bm * self.k_blocks if not self.ue8m0 else 4))
        sWs = storage.sWs.get_tensor(cute.make_layout(self.k_blocks))
        if cutlass.const_expr(not self.ue8m0):
            # Both scales of every K block of this tile, once: sXs[i * bm + j] = x_scale[m0 + j, kb].
            for idx in cutlass.range(etid, n_kb * self.bm, 32 * len(EPI_WARPS), unroll=1):
                i = idx // self.bm
                j = idx - i * self.bm
                v = Float32(0.0)
                if m0 + j < m:
                    v = mXs[m0 + j, kb_begin + i]
                sXs[idx] = v
            for i in cutlass.range(etid, n_kb, 32 * len(EPI_WARPS), unroll=1):
                sWs[i] = mWs[nb, kb_begin + i]
            epi_bar.arrive_and_wait()

        tmem.allocate(TMEM_COLS)
        tmem.wait_for_alloc()
        acc_ptr = tmem.retrieve_ptr(Float32)
        tCtAcc_base = cute.make_tensor(acc_ptr, tCtAcc_fake.layout)
        tAcc = tCtAcc_base[((None, None), 0, 0, None)]                   # (128, bm, ACC_STAGE)
        epi_tile = (TC_TILE_N, EPI_COLS)
        tAcc_epi = cute.flat_divide(tAcc, epi_tile)                      # (128, 32, 1, C, ACC_STAGE)
        atom = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), Float32)
        t2r = tcgen05.make_tmem_copy(atom, tAcc_epi[(None, None, 0, 0, 0)])
        thr = t2r.get_slice(etid)
        tTR_t = thr.partition_S(tAcc_epi)                               # (T2R, 1, 1, 1, C, ACC_STAGE)
        cAcc = cute.flat_divide(cute.make_identity_tensor((TC_TILE_N, self.bm)), epi_tile)
        tTR_c = thr.partition_D(cAcc)                                    # (T2R, 1, 1, 1, C)
        chunks = self.bm // EPI_COLS
        frag = cute.make_rmem_tensor(tTR_c[(None, None, None, 0, 0)].shape, Float32)
        per = cute.size(frag)
        acc = cute.make_rmem_tensor(cute.make_layout((per, chunks)), Float32)
        acc.fill(0.0)

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.acc_stages)
        if cutlass.const_expr(self.ue8m0):
            acc_pipe.consumer_wait(state)
            for c in cutlass.range_constexpr(chunks):
                cute.copy(t2r, tTR_t[(None, None, None, 0, c, 0)], frag)
                for e in cutlass.range_constexpr(per):
                    acc[e, c] = frag[e]
            cute.arch.fence_view_async_tmem_load()
            acc_pipe.consumer_release(state)
            state.advance()
        else:
            for i in cutlass.range(n_kb, unroll=1):
                acc_pipe.consumer_wait(state)
                ws = sWs[i]
                for c in cutlass.range_constexpr(chunks):
                    cute.copy(t2r, tTR_t[(None, None, None, 0, c, state.index)], frag)
                    for e in cutlass.range_constexpr(per):
                        col = tTR_c[(e, 0, 0, 0, c)][1]
                        acc[e, c] = acc[e, c] + frag[e] * (ws * sXs[i * self.bm + col])
                cute.arch.fence_view_async_tmem_load()
                acc_pipe.consumer_release(state)
                state.advance()

        if cutlass.const_expr(split is None):
            self._store(acc, tTR_c, chunks, per, mOut, m, m0, n0)
        else:
            if split == 1:
                self._store(acc, tTR_c, chunks, per, mOut, m, m0, n0)
            else:
                # This CTA's FP32 partial, token-major (red[token * 128 + row]), for the cluster sum.
                for c in cutlass.range_constexpr(chunks):
                    for e in cutlass.range_constexpr(per):
                        row, col = tTR_c[(e, 0, 0, 0, c)]
                        red[col * TC_TILE_N + row] = acc[e, c]

        tmem.relinquish_alloc_permit()
        epi_bar.arrive_and_wait()
        tmem.free(acc_ptr)

    @cute.jit
    def _store(self, acc, tTR_c, chunks, per, mOut, m, m0, n0):
        for c in cutlass.range_constexpr(chunks):
            for e in cutlass.range_constexpr(per):
                row, col = tTR_c[(e, 0, 0, 0, c)]
                if n0 + row < self.n and m0 + col < m:
                    mOut[m0 + col, n0 + row] = acc[e, c].to(cutlass.BFloat16)


# A short, stable symbol instead of the DSL's mangled one (which spells out every argument type).
Fp8BlockGemmKernel.kernel.set_name_prefix("k3gen_fp8_block_gemm", remove_cutlass_symbol=True,
                                          keep_mangled_name=False)
Fp8BlockGemmKernel.kernel_tma.set_name_prefix("k3gen_fp8_block_gemm_tma", remove_cutlass_symbol=True,
                                              keep_mangled_name=False)


def compile_args(spec: Fp8BlockGemmSpec):
    """(jit callable, [(name, fake tensor), ...]) in kernel parameter order, for cute.compile.

    M is the one dynamic dim (a 32-bit SymInt shared by x, x_scales and out); N, K and every stride
    are static, so each tensor parameter carries its pointer and, for the M-sized ones, M.
    """
    arch = os.environ["CUTE_DSL_ARCH"]
    m = cute.sym_int32(symbol="M")
    scale_t = cutlass.Uint8 if spec.recipe is ScaleRecipe.UE8M0 else cutlass.Float32
    e4m3 = cutlass.Float8E4M3FN
    args = [
        ("x_codes", make_fake_compact_tensor(e4m3, (m, spec.k), stride_order=(1, 0), assumed_align=16)),
        ("x_scales", make_fake_compact_tensor(scale_t, (m, spec.k_blocks), stride_order=(1, 0),
                                              assumed_align=scale_t.width // 8)),
        ("w_codes", make_fake_compact_tensor(e4m3, (spec.n, spec.k), stride_order=(1, 0),
                                             assumed_align=16)),
        ("w_scales", make_fake_compact_tensor(scale_t, (spec.n_blocks, spec.k_blocks),
                                              stride_order=(1, 0), assumed_align=scale_t.width // 8)),
        ("out", make_fake_compact_tensor(cutlass.BFloat16, (m, spec.n), stride_order=(1, 0),
                                         assumed_align=16)),
    ]
    return Fp8BlockGemmKernel(spec, arch), args
