"""A fake clock for the loop (``decoder``'s ``time``), so that what the
rounds measure (the batch policy's round times, the round-cost corrections)
is the same on any machine, loaded or not: the trunk's forwards advance it,
nothing else does."""

import types

from mlx_mtp import decoder

MS = 1e-3


def fake_clock(monkeypatch, model, per_token=True):
    """The loop's clock advances only by the trunk's forwards: one ms per
    token a forward reads (``per_token``), else one ms whatever it reads.
    A plain step's ms is counted when its token is read, as the loop waits
    for it (a step run ahead computes while the round before it ends)."""
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(
        decoder, "time", types.SimpleNamespace(perf_counter=lambda: clock.now)
    )
    forward, read = model.target.forward, decoder._Ahead.read

    def timed(tokens, cache, pieces=None, **kw):
        if tokens.shape[1] > 1:
            clock.now += (tokens.shape[1] if per_token else 1) * MS
        return forward(tokens, cache, pieces, **kw)

    def waited(ahead):
        clock.now += MS
        return read(ahead)

    monkeypatch.setattr(model.target, "forward", timed)
    monkeypatch.setattr(decoder._Ahead, "read", waited)
    return clock
