"""The double-buffered HBM -> VMEM page copies of one TPU kernel program (`PageChunks`).

A program walks its pages in chunks of `pages_per_iter` pages. Two VMEM slots hold two chunks: while the
program computes on chunk c in one slot, the DMAs of chunk c + 1 fill the other, started before chunk c's
compute and waited on only when chunk c + 1 is needed. Each slot has one DMA semaphore per page array copied
(K and V for the GQA kernels, the latent pages for MLA); every page copy signals it and every wait consumes one
page's worth, so a chunk is complete when each of its page copies has been waited on. Only pages below the
program's end page are copied: block-table entries past a sequence's length are never read, so they may hold
anything.

The first chunk of a program is not overlapped with the previous program's compute (each program owns its
DMAs, which keeps every grid dimension parallel); prefetching across grid steps, as JAX's own TPU op does,
would hide that one DMA latency per program at the cost of sequential ("arbitrary") grid semantics.
"""

from __future__ import annotations

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


class PageChunks:
    """The double-buffered HBM -> VMEM copies of one program's pages, `pages_per_iter` pages per chunk.

    streams: one (hbm, lead, buf) per page array copied, all through the same block table: hbm in memory space
    ANY (never blocked), page `physical` of it being `hbm.at[(*lead, physical)]` `[block_size, width]` (the GQA
    kernels copy K and V with lead = (head,): `[num_kv_heads, num_blocks, block_size, head_dim]`; the MLA
    kernels one latent page array with lead = ()); buf VMEM `[2, pages_per_iter * block_size, width]`: page i of
    a chunk lands in rows i * block_size ... (a tile-aligned window under the block-size rule), so a chunk is
    one matrix per stream without any reshape. sems DMA `[len(streams), 2]` (stream x buffer slot),
    table_ref the flattened block tables in SMEM, table_row the offset of this sequence's row in it.
    Chunk c holds logical pages first_page + c * P + i for i < P; only pages below page_end are copied
    (a table entry past the length is never read, so it may hold anything); the rest of the slot keeps
    stale data, which the caller masks.
    """

    def __init__(self, table_ref, streams, sems, *, table_row, first_page, page_end, block_size: int):
        self.table_ref, self.streams, self.sems = table_ref, tuple(streams), sems
        self.table_row, self.first_page, self.page_end = table_row, first_page, page_end
        self.block_size = block_size
        self.pages = self.streams[0][2].shape[1] // block_size

    def _each_page(self, chunk, slot, action):
        for i in range(self.pages):  # static unroll: one DMA per page and stream
            page = self.first_page + chunk * self.pages + i

            @pl.when(page < self.page_end)
            def _(page=page, i=i):
                physical = self.table_ref[self.table_row + page]
                for n, (hbm, lead, buf) in enumerate(self.streams):
                    window = buf.at[slot, pl.ds(i * self.block_size, self.block_size)]
                    action(pltpu.make_async_copy(hbm.at[(*lead, physical)], window, self.sems.at[n, slot]))

    def start(self, chunk, slot):
        self._each_page(chunk, slot, lambda copy: copy.start())

    def wait(self, chunk, slot):
        self._each_page(chunk, slot, lambda copy: copy.wait())

    def fold(self, num_chunks, step, carry):
        """`carry = step(*chunk, first_pos, carry)` over chunks 0 .. num_chunks - 1 (chunk: one `[pages_per_iter
        * block_size, width]` matrix per stream; first_pos: the position of its first row), the next chunk's
        DMAs in flight while the current one is computed on."""

        @pl.when(num_chunks > 0)
        def _():
            self.start(0, 0)

        def body(c, carry):
            slot = lax.rem(c, 2)

            @pl.when(c + 1 < num_chunks)
            def _():
                self.start(c + 1, 1 - slot)

            self.wait(c, slot)
            chunk = [buf[slot] for _, _, buf in self.streams]
            return step(*chunk, (self.first_page + c * self.pages) * self.block_size, carry)

        return lax.fori_loop(0, num_chunks, body, carry)
