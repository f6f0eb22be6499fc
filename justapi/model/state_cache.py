"""The state cache of a hybrid model, beside its paged KV pool: each recurrent layer's fixed-size state
(model.recurrent) in slots, one per running sequence. A sequence takes a slot when the runner first sees it and gives
it back when it finishes or is preempted (it then recomputes its tokens, as its KV blocks are freed too). The engine
allocates as many slots as it runs sequences at most (``--max-seqs``) and counts them in the pool's memory budget, so
a running sequence always finds one.
"""

from __future__ import annotations

import torch


def recurrent_layers(model) -> list[int]:
    """The indices of ``model``'s layers with a recurrent state instead of a KV cache."""
    layers = getattr(model, "layers", [])  # an encoder's layers have no token mixer of this kind
    return [i for i, layer in enumerate(layers) if hasattr(getattr(layer, "attn", None), "state_shapes")]


def state_bytes_per_seq(model) -> int:
    """Bytes of one sequence's state across every recurrent layer (0 for a model without any); states are fp32."""
    return sum(4 * _numel(shape) for i in recurrent_layers(model) for shape in model.layers[i].attn.state_shapes())


def layer_caches(model, kv_caches: list, states: StateCache | None) -> list:
    """What each of ``model``'s layers reads in its forward pass: an attention layer its (K, V) from
    ``kv_caches`` (the attention layers', in order), a recurrent one its LayerStates."""
    if states is None or not states.layers:
        return kv_caches
    kv = iter(kv_caches)
    return [states.layers[i] if i in states.layers else next(kv) for i in range(len(model.layers))]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class LayerStates:
    """One recurrent layer's states: ``tensors`` [slots + snapshots, ...], and while a step verifies drafts, each
    verifying sequence's state after each of its rows (``checkpoints[slot][row]``), until the runner keeps the
    accepted one."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.checkpoints: dict[int, list[list[torch.Tensor]]] = {}


class StateCache:
    """Per recurrent layer, its state tensors [slots + snapshots, ...] (fp32, zeroed); which request holds which
    slot. Snapshot k (core.state_snapshots: the prefix cache's states, which the scheduler assigns) is row
    ``slots + k``."""

    def __init__(self, model, slots: int, device: str, snapshots: int = 0) -> None:
        self.num_slots = slots
        self.num_snapshots = snapshots
        self.layers: dict[int, LayerStates] = {
            i: LayerStates([torch.zeros((slots + snapshots, *shape), dtype=torch.float32, device=device)
                            for shape in model.layers[i].attn.state_shapes()])
            for i in recurrent_layers(model)}
        self._free = list(range(slots))[::-1]
        self._slots: dict[str, int] = {}

    def slot(self, request_id: str) -> int:
        """``request_id``'s slot, taken now if it has none (the scheduler runs no more sequences than slots) and
        zeroed: a sequence's first step may be a single token, which steps with the decode rows from its slot."""
        if request_id not in self._slots:
            if not self._free:
                raise RuntimeError(f"state cache: all {self.num_slots} slots are taken (--max-seqs bounds them)")
            slot = self._slots[request_id] = self._free.pop()
            for layer in self.layers.values():
                for t in layer.tensors:
                    t[slot].zero_()
        return self._slots[request_id]

    def load(self, request_id: str, snapshot: int) -> None:
        """``request_id``'s state becomes snapshot ``snapshot``'s (a cached prefix's end)."""
        self._copy(self.num_slots + snapshot, self.slot(request_id))

    def save(self, request_id: str, snapshot: int) -> None:
        """Snapshot ``snapshot`` becomes ``request_id``'s state as it is now."""
        self._copy(self._slots[request_id], self.num_slots + snapshot)

    def keep(self, request_id: str, row: int) -> None:
        """A verified draft: ``request_id``'s state becomes the one after row ``row`` of its verification (the last
        token it accepted)."""
        slot = self._slots[request_id]
        for layer in self.layers.values():
            for t, kept in zip(layer.tensors, layer.checkpoints[slot][row]):
                t[slot] = kept

    def drop_checkpoints(self) -> None:
        for layer in self.layers.values():
            layer.checkpoints.clear()

    def export(self, request_id: str) -> torch.Tensor:
        """``request_id``'s states, every layer's flattened and concatenated (what a KV transfer carries)."""
        slot = self._slots[request_id]
        return torch.cat([t[slot].flatten() for layer in self.layers.values() for t in layer.tensors])

    def import_(self, request_id: str, flat: torch.Tensor) -> None:
        """``request_id``'s states from ``export``'s form."""
        slot, offset = self.slot(request_id), 0
        for layer in self.layers.values():
            for t in layer.tensors:
                n = t[slot].numel()
                t[slot] = flat[offset : offset + n].view(t.shape[1:])
                offset += n

    def _copy(self, src: int, dst: int) -> None:
        for layer in self.layers.values():
            for t in layer.tensors:
                t[dst] = t[src]

    def release(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    @property
    def num_used(self) -> int:
        return len(self._slots)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers.values() for t in layer.tensors)
