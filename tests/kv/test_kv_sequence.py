"""The block manager sees a sequence only through kv.kv_sequence.KVSequence (kv/ sits below the engine): the
engine's Sequence must have all of it, and whatever the block manager reads of a sequence must be declared
there, so the Protocol cannot drift from what the block manager really uses."""
import ast
from pathlib import Path

from reuse_server.engine.sampling_params import SamplingParams
from reuse_server.engine.sequence import Sequence
from reuse_server.kv import block_manager
from reuse_server.kv.kv_sequence import KVSequence, PinMarks


def members(protocol) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")} | set(protocol.__annotations__)


def reads_of(source: Path, annotation: str) -> tuple[set[str], set[str]]:
    """(attributes read of each parameter annotated `annotation`, attributes read of its `.options`)."""
    direct, options = set(), set()
    for func in ast.walk(ast.parse(source.read_text())):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = {a.arg for a in func.args.args + func.args.kwonlyargs
                  if isinstance(a.annotation, ast.Name) and a.annotation.id == annotation}
        for node in ast.walk(func):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in params:
                direct.add(node.attr)
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "options" and isinstance(node.value.value, ast.Name)
                    and node.value.value.id in params):
                options.add(node.attr)
    return direct, options


def test_the_engines_sequence_has_what_the_block_manager_reads():
    seq = Sequence("r", [1, 2, 3], SamplingParams())
    assert [name for name in members(KVSequence) if not hasattr(seq, name)] == []
    assert [name for name in members(PinMarks) if not hasattr(seq.options, name)] == []


def test_the_block_manager_reads_only_what_the_protocol_declares():
    direct, options = reads_of(Path(block_manager.__file__), "KVSequence")
    assert direct, "the block manager's methods take no KVSequence: the scan found nothing to check"
    assert direct - members(KVSequence) == set()
    assert options and options - members(PinMarks) == set()


def test_the_scan_sees_an_undeclared_read(tmp_path):
    source = tmp_path / "manager.py"
    source.write_text("def admit(self, seq: KVSequence):\n    return seq.params, seq.options.cache_salt\n")
    direct, options = reads_of(source, "KVSequence")
    assert direct - members(KVSequence) == {"params"}
    assert options - members(PinMarks) == {"cache_salt"}
