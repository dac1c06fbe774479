"""The NeMo-Aligner facts (``interface_facts.NEMO_ALIGNER_GENERATE``, read from the archived
repository) held to the released package itself: ``nemo-aligner==0.7.0`` from the public index
(the dev extra; it declares only Jinja2 and jsonlines) is read with ``ast``, never imported
(importing it needs NeMo and TensorRT-LLM): ``GPTGenerateTRTLLM``'s methods take the parameters
the facts record, its constructor the keywords the actors pass, and ``generate`` returns the
recorded keys."""
from __future__ import annotations

import ast
import importlib.metadata

import pytest

from nemo_tlt.integrations.interface_facts import NEMO_ALIGNER_GENERATE, NEMO_ALIGNER_GENERATE_INIT


@pytest.fixture(scope="module")
def generate_class() -> ast.ClassDef:
    dist = importlib.metadata.distribution("nemo-aligner")
    source = dist.locate_file("nemo_aligner/utils/trt_llm.py").read_text()
    found = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == "GPTGenerateTRTLLM"]
    assert len(found) == 1, f"nemo-aligner {dist.version}: no single GPTGenerateTRTLLM in nemo_aligner/utils/trt_llm.py"
    return found[0]


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def test_the_released_package_has_the_methods_the_facts_record(generate_class):
    methods = _methods(generate_class)
    for fact in NEMO_ALIGNER_GENERATE.methods:
        assert fact.name in methods, fact.name
        args = methods[fact.name].args
        assert [a.arg for a in args.args] == ["self", *(p.name for p in fact.params)], fact.name
        assert not args.kwonlyargs and args.vararg is None and args.kwarg is None, fact.name
    init = methods["__init__"].args
    assert tuple(a.arg for a in init.args[1:]) == NEMO_ALIGNER_GENERATE_INIT


def test_the_released_generate_returns_the_recorded_keys(generate_class):
    returned = [n for n in ast.walk(_methods(generate_class)["generate"]) if isinstance(n, ast.Dict)]
    keys = {k.value for d in returned for k in d.keys if isinstance(k, ast.Constant)}
    assert keys == {key.name for key in NEMO_ALIGNER_GENERATE.outputs}
