"""What a worker's tensor-parallel ranks 1..n-1 run beside their shard: their own transfer
agent with their pool registered (the `endpoint` op), and the notifications that agent
receives (`notifications`: a decode rank's pushes in). Installed by open_endpoint with
`extend` (pdserve/engine/tp_rank.py); the prefill role's subclass adds the push of the
rank's own KV heads (prefill/rank.py).
"""

from __future__ import annotations

from pdserve.serving.kv_pool import layout_spec, rank_layout
from transfer import PoolLayout, TransferAgent, make_agent


class RankEndpoint:
    def __init__(self, state) -> None:
        self.state = state  # the rank's RankState: its spec, config, cache
        self.agent: TransferAgent | None = None
        self.layout: PoolLayout | None = None

    def op_endpoint(self, backend: str, name: str, model_name: str) -> tuple[bytes, PoolLayout]:
        """Open this rank's agent (named after rank 0's), register its pool -> what a peer
        needs: (agent metadata, the pool's layout with this rank's heads)."""
        st = self.state
        self.agent = make_agent(backend, f"{name}.r{st.spec.rank}")
        pool = st.cache.pool
        spec = layout_spec(model_name, st.config, pool.dtype, st.cache.block_size)
        region = self.agent.register(pool)
        self.layout = rank_layout(
            spec, st.config, pool, st.cache.block_dim, region, st.spec.rank, st.spec.size
        )
        return self.agent.metadata(), self.layout

    def op_blocks(self, block_ids: list[int]):
        """A copy of these blocks of this rank's pool, every layer (diagnostics, tests), as
        a numpy array: a torch tensor would travel as a shared-memory handle, which only
        multiprocessing's own children may open."""
        import torch

        pool, dim = self.state.cache.pool, self.state.cache.block_dim
        ids = torch.tensor(block_ids, dtype=torch.long, device=pool.device)
        return pool.index_select(dim, ids).cpu().numpy()

    def op_notifications(self) -> list[bytes]:
        """Every notification this rank's agent received since the last call."""
        if self.agent is None:
            return []
        return [note for notes in self.agent.notifications().values() for note in notes]

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
