"""A pytest plugin: check any project's KL estimator against the lab, in that project's own test suite.

Installed with ema-pg (entry point ``pytest11``), it offers two ways in:

1. **From the command line**, no test file needed::

       pytest --kl-conformance mypkg.kl:my_k3 \\
              --kl-claims "direction=reverse,value=unbiased,gradient=unbiased,off_policy=true"

   adds one test per claim and setting. Claims come from ``--kl-claims`` or, if absent, from a
   ``kl_claims`` dict attribute on the function (``my_k3.kl_claims = {"gradient": "unbiased"}``).

2. **As a fixture**::

       def test_my_estimator(kl_conformance):
           kl_conformance(my_k3, direction="reverse", gradient="unbiased", off_policy=True)

A failure reads, one line per refuted claim::

    gradient unbiased, off-policy: E[grad] differs from the true gradient of KL(pi || ref) by 0.031
    (relative 12.0%) at k=2, off-policy (tokens from pi_old) (case 'far', V=8)

The estimator takes :class:`ema_pg.kl.KLInputs` and returns a (B, T) tensor, differentiable in the
policy's log-probs: ``logp``, ``logp_old`` and ``logp_ref`` at the sampled ``tokens``; with an index
set (``index=policy_old`` or ``index=anchor`` in the claims), ``topk_idx``, ``topk_logp``,
``topk_logp_ref``. A function of plain log-prob tensors is one line away:
``lambda inp: my_kl(inp.logp, inp.logp_ref)``.

The lab is imported only when one of these is used: the plugin costs a pytest session nothing else.
"""

from __future__ import annotations

import importlib

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("kl-conformance", "KL-estimator conformance (ema-pg's estimator lab)")
    group.addoption("--kl-conformance", action="append", default=[], metavar="MODULE:FUNCTION",
                    help="check this estimator's claims by exact enumeration (repeatable)")
    group.addoption("--kl-claims", default=None, metavar="CLAIMS",
                    help="e.g. 'direction=reverse,value=unbiased,gradient=unbiased,off_policy=true,index=policy_old,ks=0;1;2'")


def _load(spec: str):
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise pytest.UsageError(f"--kl-conformance {spec!r}: give MODULE:FUNCTION, e.g. mypkg.kl:my_k3")
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise pytest.UsageError(f"--kl-conformance {spec!r}: cannot import {module!r} ({e})") from None
    for part in name.split("."):
        if not hasattr(obj, part):
            raise pytest.UsageError(f"--kl-conformance {spec!r}: {module!r} has no {name!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise pytest.UsageError(f"--kl-conformance {spec!r}: {name!r} is not callable")
    return obj


def _claims(fn, text: str | None, spec: str):
    from .lab import Claims

    try:
        if text is not None:
            return Claims.parse(text)
        return Claims(**getattr(fn, "kl_claims", {}))
    except (TypeError, ValueError) as e:
        raise pytest.UsageError(f"--kl-conformance {spec!r}: bad claims: {e}") from None


class _Findings:
    """One estimator's findings, computed once (when the first of its items runs) and shared by its items."""

    def __init__(self, fn, claims):
        self.fn, self.claims, self._found = fn, claims, None

    def get(self, what: str, setting: str):
        if self._found is None:
            from .lab import check

            self._found = {(f.what, f.setting): f for f in check(self.fn, self.claims)}
        return self._found[(what, setting)]


class ConformanceItem(pytest.Item):
    """One claim of one estimator in one setting (on- or off-policy)."""

    def __init__(self, *, findings: _Findings, key: tuple[str, str], **kw):
        super().__init__(**kw)
        self.findings, self.key = findings, key

    def runtest(self):
        try:
            f = self.findings.get(*self.key)
        except ValueError as e:  # an estimator that breaks the contract (its output's shape): one line
            raise AssertionError(str(e)) from None
        if not f.ok:
            raise AssertionError(f.message)

    def repr_failure(self, excinfo, style=None):
        return str(excinfo.value)

    def reportinfo(self):
        return self.path, None, self.name


def pytest_collection_modifyitems(session, config, items):
    for spec in config.getoption("kl_conformance"):
        fn = _load(spec)
        claims = _claims(fn, config.getoption("kl_claims"), spec)
        findings = _Findings(fn, claims)
        for setting in ("on", "off") if claims.off_policy else ("on",):
            for what in ("value", "gradient"):
                if getattr(claims, what) is None:
                    continue
                name = f"kl_conformance[{spec}::{what}-{getattr(claims, what)}::{setting}-policy]"
                items.append(ConformanceItem.from_parent(session, name=name, findings=findings, key=(what, setting)))


@pytest.fixture
def kl_conformance():
    """``kl_conformance(fn, **claims)``: raises a readable AssertionError for every refuted claim."""
    from .lab import assert_conforms

    def run(fn, claims=None, **kw):
        return assert_conforms(fn, claims, **kw)

    return run
