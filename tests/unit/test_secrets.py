"""Secrets in configs (``configs.secrets``): where they are read from, what a config shows of them, how
keys are compared, and a KV server that will not open to the network without a token."""

import hmac

import pytest

import configs.secrets as secrets
from cluster.kv_server import KVServer
from configs.secrets import Secret, loopback, matches
from configs.serve import ServeConfig


def test_a_secret_is_read_from_its_variable_or_file_and_shows_only_where_it_comes_from(tmp_path, monkeypatch):
    monkeypatch.setenv("MLAPOOL_UNIT_KEY", "v4lue-from-env")
    (tmp_path / "key").write_text("v4lue-from-file\n")
    from_env, from_file = Secret.of({"env": "MLAPOOL_UNIT_KEY"}, "k"), Secret.of({"file": str(tmp_path / "key")}, "k")
    inline = Secret.of("v4lue-inline", "k")
    assert (from_env.reveal(), from_file.reveal(), inline.reveal()) == ("v4lue-from-env", "v4lue-from-file", "v4lue-inline")
    shown = repr(ServeConfig(kv_token=inline, api_keys=[{"env": "MLAPOOL_UNIT_KEY"}], decode_api_key={"file": str(tmp_path / "key")}))
    assert "v4lue" not in shown and "Secret(<inline>)" in shown and "Secret(env='MLAPOOL_UNIT_KEY')" in shown
    assert inline.inline and not from_env.inline


@pytest.mark.parametrize("raw, got", [({"env": "X", "file": "/y"}, "['env', 'file']"), ({"vault": "x"}, "['vault']"), ("", "str"), (42, "int")])
def test_a_malformed_secret_is_refused_naming_the_field_and_the_forms(raw, got):
    with pytest.raises(ValueError) as error:
        ServeConfig(kv_token=raw)
    assert str(error.value) == f"serve config: kv_token must be {{env: VARIABLE}}, {{file: PATH}} or a non-empty string; got {got}"


def test_a_missing_variable_or_file_is_named_and_no_value_is_shown(tmp_path, monkeypatch):
    monkeypatch.delenv("MLAPOOL_UNIT_MISSING", raising=False)
    with pytest.raises(ValueError, match="the environment variable MLAPOOL_UNIT_MISSING is not set"):
        Secret(env="MLAPOOL_UNIT_MISSING").reveal()
    with pytest.raises(ValueError, match=f"cannot read the secret file {tmp_path / 'none'}"):
        Secret(file=str(tmp_path / "none")).reveal()
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        Secret(file=str(tmp_path / "empty")).reveal()


def test_keys_are_compared_in_constant_time_with_every_key(monkeypatch):
    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(secrets.hmac, "compare_digest", lambda a, b: compared.append(b) or real(a, b))
    assert matches("k2", ["k1", "k2", "k3"]) and len(compared) == 3  # no early exit on the match
    assert not matches(None, ["k1"]) and not matches("", ["k1"]) and not matches("k", [])


def test_a_kv_server_open_to_the_network_needs_a_token():
    assert loopback("127.0.0.1") and loopback("127.3.0.1") and loopback("::1") and loopback("localhost")
    assert not loopback("0.0.0.0") and not loopback("10.1.2.3") and not loopback("prefill-host")
    with pytest.raises(ValueError, match="kv_host '0.0.0.0' opens the KV server to the network without a kv_token"):
        ServeConfig(kv_host="0.0.0.0")
    assert ServeConfig(kv_host="0.0.0.0", kv_token={"env": "MLAPOOL_KV_TOKEN"}).kv_token.env == "MLAPOOL_KV_TOKEN"
    with pytest.raises(ValueError, match="a KV server on '0.0.0.0' without a token"):
        KVServer(None, host="0.0.0.0")  # refused before anything is bound or asked of the pool


def test_decode_keys_per_server_and_for_all():
    config = ServeConfig(decode_servers=("http://a:1", "http://b:2"), decode_api_key="all", decode_api_keys={"http://b:2": "mine"})
    assert config.decode_key("http://a:1").reveal() == "all" and config.decode_key("http://b:2").reveal() == "mine"
    with pytest.raises(ValueError, match=r"decode_api_keys must map URLs of decode_servers to secrets; not among them: \['http://c:3'\]"):
        ServeConfig(decode_servers=("http://a:1",), decode_api_keys={"http://c:3": "x"})


def test_a_config_file_names_its_secrets_and_never_holds_them():
    with pytest.raises(ValueError, match=r"serve config: kv_token, api_keys\[1\] written inline; name each secret as \{env: VARIABLE\} or \{file: PATH\}"):
        ServeConfig.from_dict({"kv_token": "s3cret", "api_keys": [{"env": "K"}, "inline-key"]})
    assert ServeConfig.from_dict({"kv_token": {"file": "/run/secrets/kv"}}).kv_token.file == "/run/secrets/kv"
