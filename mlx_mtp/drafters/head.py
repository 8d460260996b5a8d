"""The model's own MTP head (one layer, or a chain of layers), or a Gemma 4
assistant, as a drafter.

Draft 1 comes from head layer 0 reading every pending pair (the stream's
last token completes the last) in ONE call per round, whose last output is
already draft 1 (the head's catch-up is folded into the draft); draft
``j + 1`` comes from layer ``j``, which reads its complete pairs and, as
tentative entries, the layer below's outputs with the drafts they made.
Past the last layer the last layer chains on its own output.
"""

from typing import Any, List, Sequence, Tuple

import mlx.core as mx

from ..drafter import Drafter, DraftView, Reads
from ..heads.base import MTPHead
from ..sampling import Draft


class HeadDrafter(Drafter):
    """Drafts from ``head`` (an ``MTPHead``: a single layer drafts every
    depth, a ``MultiLayerHead``'s layer ``j`` depth ``j + 1``)."""

    name = "mtp"

    def __init__(self, head: MTPHead):
        self.head = head
        # a head that reads the target's caches (a Gemma 4 assistant), or
        # a trunk layer's output (DeepSeek-V4.1's streams), says so
        self.reads = Reads(
            layers=tuple(getattr(head, "reads_layers", ())),
            kv=hasattr(head.make_cache()[0], "link"),
        )
        self.reads_last = bool(getattr(head, "reads_last_input", False))

    @property
    def num_layers(self) -> int:
        return self.head.num_layers

    def make_caches(self) -> List[Any]:
        return self.head.make_cache()

    def layer_cache(self, caches: List[Any], j: int) -> List[Any]:
        return self.head.layer_cache(caches, j)

    def _read(self, view: DraftView, j: int, items) -> Tuple[List, List]:
        """Head layer ``j`` over each stream's item: per stream its logits at
        its last input (``[1, V]``) and its outputs (``[1, L, D]``)."""
        layer = self.head.layer(j)
        caches = self.head.layer_cache(view.caches(self), j)
        last, outs = view.ragged(layer.states, items, caches)
        logits = layer.logits(last)[:, -1]  # the projection at the last inputs only
        return [
            None if it is None else logits[b : b + 1] for b, it in enumerate(items)
        ], outs

    def catch_up(self, view: DraftView, streams: Sequence[Any]) -> None:
        """Every head layer of every stream reads its complete pairs, passing
        its outputs up to the next layer."""
        for j in range(self.num_layers):
            items = []
            for s in streams:
                q = self.state(s).pending[j]
                n = len(q.tokens)
                items.append((q.hidden[:, :n], list(q.tokens)) if n else None)
            if not any(items):
                continue
            _, outs = self._read(view, j, items)
            for s, it, out in zip(streams, items, outs):
                if it is None:
                    continue
                pending = self.state(s).pending
                if j + 1 < self.num_layers:
                    pending[j + 1].push(out, it[1])
                pending[j].drop_first(len(it[1]))

    def propose(
        self, view: DraftView, streams: Sequence[Any], ks: Sequence[int], p_min: float
    ) -> Tuple[List[List[Draft]], List[List[int]]]:
        """Layer 0 reads every pending pair (the stream's last token completes
        the last): its last output is draft 1. Layer ``j`` then reads its
        complete pairs and, as tentative entries at chain positions
        ``p + 1 .. p + j``, its last input completed by draft 1 and layer
        ``j - 1``'s tentative outputs with drafts ``2..j``: its last output is
        draft ``j + 1``. Drafts past the last layer chain the last layer on its
        own output. A stream stops taking part once it has its drafts (or its
        draft's probability falls below ``p_min``)."""
        queues = [self.state(s).pending for s in streams]
        n_layers = self.num_layers
        drafts: List[List[Draft]] = [[] for _ in streams]
        tentative = [[0] * n_layers for _ in streams]
        active = [k > 0 and q[0].hidden is not None for k, q in zip(ks, queues)]
        if not any(active):
            return drafts, tentative
        items = [
            (q[0].hidden, q[0].tokens + [s.history[-1]]) if a else None
            for s, q, a in zip(streams, queues, active)
        ]
        logits, outs = self._read(view, 0, items)
        tent: List[Any] = [None] * len(streams)  # the last layer's tentative outputs
        for b, it in enumerate(items):
            if it is not None:
                if n_layers > 1:
                    queues[b][1].push(outs[b], it[1])
                queues[b][0].drop_first(len(it[1]))
                tent[b] = outs[b][:, :0]
        for j in range(max(ks)):
            for b, s in enumerate(streams):
                if not active[b]:
                    continue
                d = s.verifier.draft(logits[b], s.history, drafts[b])
                if p_min > 0 and d.p.item() < p_min:
                    active[b] = False
                    continue
                d.source = self.name
                drafts[b].append(d)
                active[b] = j + 1 < ks[b]
            if not any(active):
                break
            if j + 1 < n_layers:  # layer j + 1 drafts depth j + 2
                logits, outs = self._next_layer(
                    view, queues, drafts, tentative, tent, active, j + 1
                )
            else:  # past the last layer: chain it on its own output
                layer, items = n_layers - 1, [None] * len(streams)
                for b in (b for b, a in enumerate(active) if a):
                    items[b] = (outs[b][:, -1:], drafts[b][-1].token)
                    tentative[b][layer] += 1
                logits, new = self._read(view, layer, items)
                outs = [o if n is None else n for n, o in zip(new, outs)]
        # the head computes while the caller builds the verify graph
        mx.async_eval([d.token for ds in drafts for d in ds])
        return drafts, tentative

    def _next_layer(self, view, queues, drafts, tentative, tent, active, layer: int):
        """Head layer ``layer`` reads, for each active stream, its complete
        pairs and, tentatively, the layer below's outputs with the drafts they
        made (its last output is the next draft); returns its logits and
        outputs per stream."""
        items, known = [None] * len(queues), {}
        for b in (b for b, a in enumerate(active) if a):
            queue = queues[b][layer]
            n = len(queue.tokens)
            parts = [h for h in (queue.hidden, tent[b]) if h is not None and h.shape[1]]
            hidden = mx.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
            c = hidden.shape[1] - n  # inputs read tentatively, with the last c drafts
            toks = [mx.array(queue.tokens, dtype=mx.int32)]
            toks += [x.token.astype(mx.int32) for x in drafts[b][len(drafts[b]) - c :]]
            items[b] = (hidden, mx.concatenate(toks))
            known[b] = (n, c)
        logits, outs = self._read(view, layer, items)
        for b, (n, c) in known.items():
            queue = queues[b][layer]
            if n and layer + 1 < len(queues[b]):
                queues[b][layer + 1].push(outs[b][:, :n], queue.tokens)
            if n:
                queue.drop_first(n)
            tent[b] = outs[b][:, n:]
            tentative[b][layer] += c
        return logits, outs
