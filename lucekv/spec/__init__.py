"""Speculative decoding (DESIGN §6): drafters propose tokens, the target verifies them in one forward on the pool.

A round is propose → verify → accept → emit (`speculator.Speculator.round`); the engine calls it where it would
otherwise run one decode step. The gate (`gate.Gate`) decides, from measured times, whether rounds pay.
Drafters and the gate are bookkeeping (no numba, no GPU); the target's forward goes through the engine.
"""
