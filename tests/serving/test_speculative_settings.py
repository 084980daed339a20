"""Speculative settings are read strictly (`runtime.speculative_settings`): off outside a server
or without speculative decoding, and a name SGLang no longer publishes stops start-up with one
line naming it. A silent "off" would change which releases count toward sync points."""

import pytest

pytest.importorskip("sglang")

from sglang.srt import runtime_context  # noqa: E402

from sglang_marconi.policy.errors import MarconiError  # noqa: E402
from sglang_marconi.serving.runtime import SPEC_FIELDS, speculative_settings  # noqa: E402


class Bag:
    """A config bag as SGLang's: an unknown leaf raises AttributeError."""

    def __init__(self, **leaves):
        self.__dict__.update(leaves)

    def __getattr__(self, name):
        raise AttributeError(f"config namespace 'spec' has no leaf/subgroup {name!r}")


class Context:
    def __init__(self, published):
        self.published = set(published)

    def is_config_namespace_published(self, name):
        return name in self.published


def serve_with(monkeypatch, spec, published=("spec", "memory")):
    monkeypatch.setattr(runtime_context, "get_context", lambda: Context(published))
    monkeypatch.setattr(runtime_context, "get_spec", lambda: spec)


def test_off_outside_a_server(monkeypatch):
    serve_with(monkeypatch, spec=None, published=())
    assert speculative_settings() is None


def test_off_and_on_as_published(monkeypatch):
    serve_with(monkeypatch, Bag(speculative_algorithm=None, speculative_num_draft_tokens=None))
    assert speculative_settings() is None
    serve_with(monkeypatch, Bag(speculative_algorithm="nextn", speculative_num_draft_tokens=4))
    assert speculative_settings() == ("NEXTN", 4)


@pytest.mark.parametrize("gone", SPEC_FIELDS)
def test_a_field_sglang_no_longer_publishes_stops_start_up_naming_it(monkeypatch, gone):
    leaves = dict(speculative_algorithm="EAGLE", speculative_num_draft_tokens=4)
    del leaves[gone]
    serve_with(monkeypatch, Bag(**leaves))
    with pytest.raises(MarconiError) as err:
        speculative_settings()
    assert gone in str(err.value) and "\n" not in str(err.value)


def test_off_is_not_read_from_a_missing_algorithm(monkeypatch):
    """The worst case of the old broad except: the algorithm's name gone while speculative
    decoding runs. It must not read as "off"."""
    serve_with(monkeypatch, Bag(speculative_num_draft_tokens=4))
    with pytest.raises(MarconiError, match="speculative_algorithm"):
        speculative_settings()


def test_a_spec_namespace_gone_from_a_published_context_stops_start_up(monkeypatch):
    serve_with(monkeypatch, spec=None, published=("memory", "schedule"))
    with pytest.raises(MarconiError, match="'spec' namespace"):
        speculative_settings()


def test_get_spec_gone_stops_start_up_naming_it(monkeypatch):
    monkeypatch.delattr(runtime_context, "get_spec")
    with pytest.raises(MarconiError, match="get_spec"):
        speculative_settings()


def test_the_installed_sglang_publishes_every_field_we_read():
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    args = ServerArgs(model_path="dummy", page_size=1)
    args._mamba_cache_chunk_size = 64  # as sglang_cpu.build_cache
    set_global_server_args_for_scheduler(args)
    spec = runtime_context.get_spec()
    assert all(hasattr(spec, name) for name in SPEC_FIELDS)
    assert speculative_settings() is None  # the real bag, speculative decoding off


def test_the_runtime_reads_them_at_start_up(monkeypatch):
    from sglang_cpu import build_marconi_serving

    from sglang_marconi.serving.config import MarconiServingConfig

    serve_with(monkeypatch, Bag(speculative_algorithm="NEXTN"))
    with pytest.raises(MarconiError, match="speculative_num_draft_tokens"):
        build_marconi_serving(MarconiServingConfig(alpha=1.0, tune_workers=0))
    serve_with(monkeypatch, Bag(speculative_algorithm="NEXTN", speculative_num_draft_tokens=3))
    _, runtime = build_marconi_serving(MarconiServingConfig(alpha=1.0, tune_workers=0))
    assert runtime.speculative == ("NEXTN", 3)
    runtime.close()
