"""zerokit.stages: the four stages as records, and the wings that ask them.

- each record's sharding flags against the ZeRO paper's table, as zerokit.memory.theory_bytes
  computes it (full Ψ or Ψ/N per category);
- a record by number and by name is the same; an unknown stage is refused naming the choices;
- stage_of finds the lessons' classes and anything built on them (by the MRO), and refuses a
  torch optimizer;
- checkpoint's job_of goes by the optimizer's nearest registered class;
- train/ and bench/ test no stage against a number or a name, and at most 3 times test a stage at
  all or read what it shards: they ask the record for the answer to their question, or look rows
  up by stage (a new stage is one record, not six files);
- each answer a record gives is the one its stage's class gives (the Muon a stage runs, who
  scales its loss, what it offloads, how many elements a rank updates).
"""

import ast
import inspect
from pathlib import Path

import pytest
import torch

from conftest import run_ranks

import zerokit
from zerokit.memory import theory_bytes
from zerokit.models import OddMLP
from zerokit.stages import STAGE_NAMES, STAGES, _lesson_classes, get_stage, stage_of, wrapper

ROOT = Path(__file__).resolve().parent.parent
LITERALS = {0, 1, 2, 3, *STAGE_NAMES}


@pytest.mark.parametrize("record", STAGES, ids=lambda s: s.name)
def test_each_record_shards_what_the_papers_table_shards(record):
    psi, n = 1_000_000, 4
    whole, cut = theory_bytes(psi, record.name, 1), theory_bytes(psi, record.name, n)
    flags = {"optimizer_states": record.shards_optimizer_state, "gradients": record.shards_gradients,
             "parameters": record.shards_parameters}
    for category, sharded in flags.items():
        assert cut[category] == (whole[category] / n if sharded else whole[category]), (category, cut, whole)
    assert record.number == STAGE_NAMES.index(record.name)
    assert set(record.shards) == {c for c in cut if c in flags and cut[c] < whole[c]}
    assert record.updated_numel(psi, n) / psi == cut["optimizer_states"] / whole["optimizer_states"]


@pytest.mark.parametrize("record", STAGES, ids=lambda s: s.name)
def test_a_record_offloads_where_its_lessons_class_takes_an_offload(record):
    cls = next(c for c, s in _lesson_classes().items() if s is record)
    assert record.offloads == ("offload" in inspect.signature(cls).parameters), cls


def test_a_record_by_number_and_by_name_is_one_and_an_unknown_stage_names_the_choices():
    for record in STAGES:
        assert get_stage(record.number) is get_stage(record.name) is get_stage(record) is record
    with pytest.raises(ValueError, match=r"unknown stage 'zero4'.*'ddp', 'zero1', 'zero2', 'zero3'"):
        get_stage("zero4")


def _stages_and_jobs(rank, world_size):
    """On one gloo rank (the lessons' classes need a process group): stage_of and job_of of each optimizer."""
    from zerokit.checkpoint.optimizers import job_of

    model = OddMLP()
    params = list(model.parameters())
    matrices = [p for p in params if p.dim() == 2]
    opts = {"DistributedAdam": zerokit.DistributedAdam(params), "ZeRO1Adam": zerokit.ZeRO1Adam(params),
            "ZeRO2Adam": zerokit.ZeRO2Adam(params), "ZeRO1(SGD)": zerokit.ZeRO1(params, torch.optim.SGD, lr=0.1),
            "ZeRO2(SGD)": zerokit.ZeRO2(params, torch.optim.SGD, lr=0.1), "ZeRO3Adam": zerokit.ZeRO3Adam(OddMLP()),
            "ZeRO1Muon": zerokit.ZeRO1Muon(matrices), "SGD": torch.optim.SGD(params, lr=0.1)}
    stages, jobs = {}, {}
    for name, opt in opts.items():
        try:
            stages[name] = stage_of(opt).name
        except TypeError as e:
            stages[name] = f"TypeError: {e}"
        jobs[name] = type(job_of(model, opt)).__name__
    try:
        job_of(model, [])
    except TypeError as e:
        jobs["list"] = f"TypeError: {e}"
    # who scales an fp16 loss in PyTorch's shape: the optimizer's own MixedPrecision, or nobody inside
    # (a plain torch.optim.AdamW beside the model's wrapper: the job must)
    scalers = {}
    for record in STAGES:
        _, opt = wrapper(record, OddMLP(), half=torch.float16)
        inside = getattr(getattr(opt, "precision", None), "scaler", None) is not None
        scalers[record.name] = (record.loss_scaling, "optimizer" if inside else "job")
    return stages, jobs, scalers


def test_stage_of_and_the_checkpoint_job_go_by_the_optimizers_nearest_class():
    stages, jobs, scalers = run_ranks(_stages_and_jobs, 1)[0]
    assert all(said == found for said, found in scalers.values()), scalers
    assert stages == {"DistributedAdam": "ddp", "ZeRO1Adam": "zero1", "ZeRO2Adam": "zero2",
                      "ZeRO1(SGD)": "zero1", "ZeRO2(SGD)": "zero2",  # built on ZeRO1Adam, ZeRO2Adam
                      "ZeRO3Adam": "zero3",
                      "ZeRO1Muon": "TypeError: zerokit.checkpoint saves zerokit's DistributedAdam and ZeRO1/2/3Adam, "
                                   "not ZeRO1Muon",
                      "SGD": "TypeError: zerokit.checkpoint saves zerokit's DistributedAdam and ZeRO1/2/3Adam, not SGD"}
    # ZeRO1/ZeRO2 hold a torch optimizer per bucket (ZeROJob), not their ZeRO1Adam/ZeRO2Adam's Adam (AdamJob)
    assert jobs == {"DistributedAdam": "AdamJob", "ZeRO1Adam": "AdamJob", "ZeRO2Adam": "AdamJob",
                    "ZeRO1(SGD)": "ZeROJob", "ZeRO2(SGD)": "ZeROJob", "ZeRO3Adam": "AdamJob", "ZeRO1Muon": "MuonJob",
                    "SGD": "ReplicatedJob",  # one rank holds all of a plain model's state
                    "list": "TypeError: zerokit.checkpoint saves a model with a torch optimizer (zerokit's included), "
                            "not with list"}


def _mentions_stage(node):
    """`stage`, `args.stage`, `c.stage`, `r["stage"]`: an expression that names a stage."""
    if isinstance(node, ast.Name):
        return "stage" in node.id
    if isinstance(node, ast.Attribute):
        return "stage" in node.attr
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "stage"
    return False


def _is_stage_literal(node):
    if isinstance(node, ast.Constant):
        return node.value in LITERALS and not isinstance(node.value, bool)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_is_stage_literal(e) for e in node.elts)
    return False


def stage_literal_tests(folders):
    """file:line of every comparison of a stage with a stage's number or name in `folders`."""
    found = []
    for folder in folders:
        for path in sorted((ROOT / "zerokit" / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Compare):
                    sides = [node.left, *node.comparators]
                    if any(_mentions_stage(a) for a in sides) and any(_is_stage_literal(b) for b in sides):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def _stage_operand(node, bound):
    """A stage itself, as a comparison's side: a name or attribute naming a stage (`stage`,
    `args.stage`, `STAGE_NAMES`), a row's `r["stage"]`, get_stage(k)/stage_of(opt), the `.name` or
    `.number` of one, a name bound to one (`s = get_stage(k)`, `for s in STAGE_NAMES`), or a tuple
    holding one. A record's other attributes (`stage.shards_gradients`, `.clip`) are its answers."""
    if isinstance(node, ast.Name):
        return "stage" in node.id.lower() or node.id in bound
    if isinstance(node, ast.Attribute):
        return "stage" in node.attr.lower() or node.attr in ("name", "number") and _stage_operand(node.value, bound)
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "stage"
    if isinstance(node, ast.Call):
        return isinstance(node.func, ast.Name) and node.func.id in ("get_stage", "stage_of")
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_stage_operand(e, bound) for e in node.elts)
    return False


def _bound_to_stages(tree):
    """Names a module binds to a stage (an assignment's, a loop's or a comprehension's target), to
    a fixed point: a renamed stage is still a stage."""
    bound, size = set(), -1
    while size != len(bound):
        size = len(bound)
        for node in ast.walk(tree):
            pairs = [(t, node.value) for t in node.targets] if isinstance(node, ast.Assign) else \
                [(node.target, node.iter)] if isinstance(node, (ast.For, ast.comprehension)) else []
            for target, value in pairs:
                if _stage_operand(value, bound) and isinstance(target, ast.Name):
                    bound.add(target.id)
    return bound


def stage_tests(folders):
    """file:line of every test of which stage it is in `folders`: a comparison or membership test
    (==, !=, <, in, not in, ...) with a stage as a side (_stage_operand), whatever the other side:
    `stage == 3`, `r["stage"] == s` (a row filter), `c.stage in chosen`, `s.number >= 2`. A branch on
    a record's answer to the wing's question (`how == "optimizer"` after `how = stage.clip`) asks
    the record and is not counted: a new stage gives its answers in stages.py. Reads of what a
    stage shards are counted apart (geometry_reads)."""
    found = []
    for folder in folders:
        for path in sorted((ROOT / "zerokit" / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            bound = _bound_to_stages(tree)
            found += [f"{path.relative_to(ROOT)}:{line}" for line in sorted(
                node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
                and any(_stage_operand(a, bound) for a in [node.left, *node.comparators]))]
    return found


# What a stage is, rather than an answer to a wing's question: a wing that derives its answer from
# these (`n = shard if stage.shards_optimizer_state else psi`) tests the stage's number in disguise,
# and a new stage would have to be checked against each such derivation; the answer belongs in
# stages.py (Stage.updated_numel, .muon, .loss_scaling, .offloads, .fsdp_controls, .shards)
GEOMETRY = ("number", "shards_optimizer_state", "shards_gradients", "shards_parameters", "optimizer_inside")


def geometry_reads(folders):
    """file:line of every read of a record's geometry (GEOMETRY) in `folders`."""
    found = []
    for folder in folders:
        for path in sorted((ROOT / "zerokit" / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            found += [f"{path.relative_to(ROOT)}:{node.lineno}" for node in ast.walk(tree)
                      if isinstance(node, ast.Attribute) and node.attr in GEOMETRY]
    return sorted(found)


def test_train_and_bench_ask_the_record_not_the_stages_number():
    assert stage_literal_tests(["train", "bench"]) == []
    found = stage_tests(["train", "bench"]) + geometry_reads(["train", "bench"])
    assert len(found) <= 3, found


def test_the_scan_finds_a_stage_test_where_there_is_one(tmp_path, monkeypatch):
    # the scan itself, on code that tests a stage the old way (which it must see)
    (tmp_path / "zerokit" / "wing").mkdir(parents=True)
    (tmp_path / "zerokit" / "wing" / "m.py").write_text(
        'def f(args, c, r):\n    if args.stage == 3:\n        pass\n    x = c.stage in ("zero1", "ddp")\n'
        '    y = r["stage"] != "zero3"\n    z = args.stage in (0, 1)\n    ok = args.stage == other\n')
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert stage_literal_tests(["wing"]) == [f"zerokit/wing/m.py:{n}" for n in (2, 4, 5, 6)]
    (tmp_path / "zerokit" / "wing" / "m.py").write_text(
        'def f(rows, s, k):\n    a = [r for r in rows if r["stage"] == s]\n    x = get_stage(k)\n'
        '    b = x.number >= 2\n    y = x\n    c = y in chosen\n    d = [t for t in STAGE_NAMES if t != k]\n'
        '    e = x.shards_gradients == other\n    if x.shards_gradients:\n        pass\n'
        '    g = {r["stage"]: r for r in rows}\n')
    assert stage_tests(["wing"]) == [f"zerokit/wing/m.py:{n}" for n in (2, 4, 6, 7)]
    assert geometry_reads(["wing"]) == [f"zerokit/wing/m.py:{n}" for n in (4, 8, 9)]
