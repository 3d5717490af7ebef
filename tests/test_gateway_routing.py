"""The gateway's routing policy: when a prompt is prefilled on its decode worker."""

from __future__ import annotations

import pytest

from gateway.workers import RoutingPolicy


def test_defaults_hand_off_unless_the_prefill_queue_is_long():
    policy = RoutingPolicy()
    assert policy.max_local_prefill_tokens == 0 and policy.max_prefill_queue_tokens == 2048
    assert not policy.prefill_locally(1, prefill_queue=0, decode_queue=0)
    assert not policy.prefill_locally(500, prefill_queue=2048, decode_queue=0)  # at the threshold: remote
    assert policy.prefill_locally(500, prefill_queue=2049, decode_queue=0)
    assert policy.prefill_locally(500, prefill_queue=5000, decode_queue=4999)
    # The decode worker is no better off: stay remote.
    assert not policy.prefill_locally(500, prefill_queue=5000, decode_queue=5000)


def test_short_prompts_stay_local():
    policy = RoutingPolicy(max_local_prefill_tokens=32, max_prefill_queue_tokens=0)
    assert policy.prefill_locally(32, prefill_queue=0, decode_queue=10_000)
    assert not policy.prefill_locally(33, prefill_queue=0, decode_queue=0)
    assert not policy.prefill_locally(33, prefill_queue=10**9, decode_queue=0)  # queue rule off


def test_negative_thresholds_are_refused():
    with pytest.raises(ValueError):
        RoutingPolicy(max_local_prefill_tokens=-1)
    with pytest.raises(ValueError):
        RoutingPolicy(max_prefill_queue_tokens=-1)
