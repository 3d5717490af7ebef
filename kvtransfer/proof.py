"""A channel's one-time secret and the proof each side gives that it holds it.

The receiver makes the secret and sends it to the sender only over the control plane
(OpenKvChannel, which TLS authenticates). Whatever a channel's data plane meets
first (a rendezvous store, a Unix socket) is open to anyone who reaches it, so each
side sends an HMAC of the secret, bound to the channel and its own rank, and checks
the other's before it trusts the peer. The secret itself never travels there.
"""

from __future__ import annotations

import hashlib
import hmac

SECRET_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size


def check_secret(secret: bytes) -> None:
    if len(secret) < SECRET_BYTES // 2:
        raise ValueError(f"a channel secret needs at least {SECRET_BYTES // 2} bytes")


def channel_proof(secret: bytes, channel_id: str, rank: int) -> bytes:
    """What rank `rank` (0: the sender, 1: the receiver) of channel `channel_id` shows."""
    return hmac.new(secret, f"baton-kv-channel/{channel_id}/{rank}".encode(), hashlib.sha256).digest()


def is_proof(proof: bytes, secret: bytes, channel_id: str, rank: int) -> bool:
    """Whether `proof` is rank `rank`'s (a constant-time comparison)."""
    return hmac.compare_digest(proof, channel_proof(secret, channel_id, rank))
