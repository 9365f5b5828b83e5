"""Akri-compatible naming: published vectors, validity, shortening, collisions."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agent.core.model import naming


def test_akri_published_digest_vectors() -> None:
    assert naming.akri_digest(naming.device_key("my_local_device", "my_node", False)) == "e77db4"
    assert (
        naming.akri_digest(naming.device_key("my_local_device", "my_other_node", False)) == "099763"
    )
    assert naming.akri_digest(naming.device_key("my_shared_device", "my_node", True)) == "4294ea"


def test_shared_key_ignores_node_and_local_key_appends_it() -> None:
    assert naming.device_key("cam", "n1", True) == naming.device_key("cam", "n2", True) == "cam"
    assert naming.device_key("cam", "n1", False) == "camn1"


def test_instance_name_matches_akri_for_normal_names() -> None:
    # Akri's docs show akri-debug-echo-foo-8120fe for the debugEcho description "foo0".
    name, digest = next(naming.candidate_names("akri-debug-echo-foo", "foo0"))
    assert name == "akri-debug-echo-foo-8120fe"
    assert digest == "8120fe"
    assert naming.cdi_name("akri-debug-echo-foo", digest) == "akri.sh/akri-debug-echo-foo=8120fe"


def test_dotted_configuration_names_are_kept_like_akri_v013() -> None:
    assert naming.instance_name("cams.lobby", "abcdef") == "cams.lobby-abcdef"


def test_long_configuration_names_are_shortened_deterministically() -> None:
    long_a = "a" * 80
    long_b = "a" * 79 + "b"
    first = naming.instance_name(long_a, "123456")
    assert first == naming.instance_name(long_a, "123456")
    assert len(first) <= naming.MAX_INSTANCE_NAME_LENGTH
    assert first != naming.instance_name(long_b, "123456")
    assert naming.is_dns_subdomain(first)
    # the longest slot id still fits kubelet's 63-character device ID limit
    assert len(naming.slot_id(first, naming.MAX_CAPACITY - 1)) <= naming.KUBELET_DEVICE_ID_MAX


def test_sanitize_keeps_valid_names_and_fixes_invalid_ones() -> None:
    assert naming.sanitize_name("cams") == "cams"
    fixed = naming.sanitize_name("My_Cams!!")
    assert naming.is_dns_subdomain(fixed)
    assert fixed.startswith("my-cams")
    assert naming.sanitize_name("My_Cams!!") != naming.sanitize_name("my-cams!!")
    assert naming.is_dns_subdomain(naming.sanitize_name("..."))
    assert naming.is_dns_subdomain(naming.sanitize_name(""))


@given(st.text(min_size=0, max_size=300), st.text(min_size=1, max_size=300))
def test_any_configuration_and_device_give_valid_names(config: str, device_id: str) -> None:
    name, _ = next(naming.candidate_names(config, device_id))
    assert naming.is_dns_subdomain(name)
    assert len(name) <= naming.MAX_INSTANCE_NAME_LENGTH
    assert naming.is_dns_subdomain(naming.slot_id(name, 999))
    assert len(naming.configuration_resource_name(config)) <= naming.MAX_INSTANCE_NAME_LENGTH
    assert naming.is_dns_subdomain(naming.configuration_resource_name(config))


def test_candidate_names_are_distinct_and_deterministic() -> None:
    gen_a = naming.candidate_names("cfg", "dev")
    gen_b = naming.candidate_names("cfg", "dev")
    first = [next(gen_a) for _ in range(5)]
    assert first == [next(gen_b) for _ in range(5)]
    assert len({name for name, _ in first}) == 5


def test_slot_ids_round_trip_and_reject_foreign_ids() -> None:
    assert naming.slot_id("cfg-abcdef", 3) == "cfg-abcdef-3"
    assert naming.parse_slot_id("cfg-abcdef", "cfg-abcdef-3") == 3
    assert naming.parse_slot_id("cfg-abcdef", "cfg-abcdef-03") is None
    assert naming.parse_slot_id("cfg-abcdef", "cfg-abcdef-x") is None
    assert naming.parse_slot_id("cfg-abcdef", "cfg-abcdef-") is None
    assert naming.parse_slot_id("cfg-abcdef", "other-abcdef-1") is None
    assert naming.parse_slot_id("cfg-abcdef", "cfg-abcdef-1-2") is None


def test_hostile_device_ids_hash_without_error() -> None:
    for hostile in ["../../etc/passwd", "a\x00b", "\udcff", "é" * 1000, "x" * 100_000, ""]:
        name, digest = next(naming.candidate_names("cfg", hostile))
        assert naming.is_dns_subdomain(name)
        assert len(digest) == 6
        assert len(naming.device_fingerprint(hostile)) == 32
