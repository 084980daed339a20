"""The check behind `test_private_sglang_names.py` (`sglang_surface.check`) fails on an SGLang that
no longer provides what the table lists: a fake package laid out as SGLang, built in tmp_path,
intact (no problem) and with one thing changed at a time."""

import itertools
import sys

import pytest

from sglang_surface import check, parse_table

_fakes = itertools.count()

SCHEDULE = '''
class Adder:
    walk_limit = 3

    def _select(self, req, *, budget, has_chunked_req=False):
        self._cursor = None
        return req

    def add_one(self, req, chunked):
        return self._select(req, budget=1, has_chunked_req=chunked)

    def add_again(self, req, chunked):
        return self._select(req, budget=0, has_chunked_req=chunked)


def _helper(x, y=None):
    return x
'''

TABLE = """
| name | kind | signature | used by | for |
|---|---|---|---|---|
| `sglang.srt.schedule.Adder._select` | method | `(self, req, *, budget, has_chunked_req=...)` | us | hooked |
| `sglang.srt.schedule.Adder._select(has_chunked_req=)` | kwarg | - | us | read from the hook's kwargs |
| `sglang.srt.schedule.Adder._cursor` | walk state | - | us | reset |
| `sglang.srt.schedule.Adder.walk_limit` | class attribute | - | us | read |
| `sglang.srt.schedule._helper` | function | `(x, y=...)` | us | called |
"""


def fake_sglang(tmp_path, monkeypatch, schedule=SCHEDULE) -> str:
    """A package laid out as SGLang (`<name>.srt.schedule`), importable; returns its name."""
    name = f"fake_sglang_{next(_fakes)}"
    srt = tmp_path / name / "srt"
    srt.mkdir(parents=True)
    (tmp_path / name / "__init__.py").write_text("")
    (srt / "__init__.py").write_text("")
    (srt / "schedule.py").write_text(schedule)
    monkeypatch.syspath_prepend(str(tmp_path))
    for module in [m for m in sys.modules if m.split(".")[0] == name]:
        del sys.modules[module]
    return name


def problems_with(tmp_path, monkeypatch, schedule=SCHEDULE):
    return check(parse_table(TABLE), package=fake_sglang(tmp_path, monkeypatch, schedule))


def test_an_intact_fake_passes(tmp_path, monkeypatch):
    assert problems_with(tmp_path, monkeypatch) == []


def test_a_missing_private_name_fails(tmp_path, monkeypatch):
    schedule = SCHEDULE.replace("def _helper(x, y=None)", "def helper(x, y=None)")
    problems = problems_with(tmp_path, monkeypatch, schedule)
    assert len(problems) == 1 and problems[0].startswith("sglang.srt.schedule._helper: missing"), problems


def test_a_changed_hook_signature_fails(tmp_path, monkeypatch):
    schedule = SCHEDULE.replace("def _select(self, req, *, budget,", "def _select(self, req, extra, *, budget,")
    problems = problems_with(tmp_path, monkeypatch, schedule)
    assert len(problems) == 1, problems
    assert "Adder._select: signature is (self, req, extra, *, budget, has_chunked_req=...)" in problems[0]


def test_a_parameter_gaining_a_default_or_turning_keyword_only_fails(tmp_path, monkeypatch):
    schedule = SCHEDULE.replace("def _helper(x, y=None)", "def _helper(x, *, y=None)")
    problems = problems_with(tmp_path, monkeypatch, schedule)
    assert len(problems) == 1 and "_helper: signature is (x, *, y=...)" in problems[0], problems


def test_a_kwarg_key_no_longer_passed_by_keyword_fails(tmp_path, monkeypatch):
    """The parameter is still there (the signature row passes) but one caller passes it by
    position: a hook reading kwargs["has_chunked_req"] would never see it."""
    schedule = SCHEDULE.replace(
        "def _select(self, req, *, budget, has_chunked_req=False)", "def _select(self, req, has_chunked_req=False, *, budget)"
    ).replace("self._select(req, budget=0, has_chunked_req=chunked)", "self._select(req, chunked, budget=0)")
    table_sig = "`(self, req, *, budget, has_chunked_req=...)`"
    rows = parse_table(TABLE.replace(table_sig, "`(self, req, has_chunked_req=..., *, budget)`"))
    problems = check(rows, package=fake_sglang(tmp_path, monkeypatch, schedule))
    assert len(problems) == 1, problems
    assert "calls ._select( without has_chunked_req=" in problems[0] and "schedule.py:" in problems[0]


def test_a_kwarg_key_dropped_from_the_call_and_the_signature_fails(tmp_path, monkeypatch):
    schedule = (SCHEDULE.replace(", has_chunked_req=False)", ")")
                .replace(", has_chunked_req=chunked)", ")"))
    problems = problems_with(tmp_path, monkeypatch, schedule)
    assert any("_select(has_chunked_req=): " in p and "takes no keyword has_chunked_req" in p for p in problems), problems
    assert any("Adder._select: signature is" in p for p in problems), problems


def test_walk_state_no_longer_assigned_fails(tmp_path, monkeypatch):
    problems = problems_with(tmp_path, monkeypatch, SCHEDULE.replace("self._cursor = None", "self.cursor = None"))
    assert problems == ["sglang.srt.schedule.Adder._cursor: " + problems[0].split(": ", 1)[1]]
    assert "no longer assigns ._cursor" in problems[0]


def test_a_gone_module_or_class_fails(tmp_path, monkeypatch):
    problems = problems_with(tmp_path, monkeypatch, SCHEDULE.replace("class Adder:", "class PrefillAdder:"))
    assert len(problems) == 4 and all("its owner is gone" in p for p in problems), problems


def test_a_malformed_row_is_refused():
    with pytest.raises(ValueError, match="5 cells"):
        parse_table("| `sglang.srt.x.y` | method | us | hooked |")


def test_an_override_or_hook_that_cannot_take_sglangs_calls_is_reported():
    import inspect

    from sglang_surface import accepts, kwargs_keys_read

    def theirs(self, node, result, lock_host=False): ...

    def narrower(self, node, result): ...  # drops lock_host

    def renamed(self, node, res, lock_host=False): ...  # result=... by keyword would fail

    def around(original, self, *args, **kwargs):
        return kwargs.get("lock_host"), kwargs["result"], "node" in kwargs

    sig = inspect.signature(theirs)
    assert accepts(inspect.signature(theirs), sig, leading=1) == []
    assert accepts(inspect.signature(around), sig, leading=2) == []
    assert accepts(inspect.signature(narrower), sig, leading=1)
    assert accepts(inspect.signature(renamed), sig, leading=1)
    assert kwargs_keys_read(around) == {"lock_host", "result", "node"}
