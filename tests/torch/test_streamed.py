"""The streamed sampler (issue 43, item 3): JSONL/parquet shards and a ``datasets`` stream resumed at other
world sizes give every sample once and the unbroken run's steps; PadfreeTrainer trains a stream and resumes
it; bad input is one line naming the source and the rule."""

from __future__ import annotations

import json

import numpy as np
import pytest

from padfree import PlanConfig
from padfree.data.sample_streams import HFStreamSamples, IteratorSamples, ShardSamples
from padfree.errors import ConfigError
from padfree.torch.feed.streamed import Stream, StreamBatchSampler

N = 300
CFG = PlanConfig(strategy="packed", budget=128, grad_accum=2, seed=0)


def _data() -> list[dict]:
    lens = np.random.default_rng(0).integers(3, 60, N)
    return [{"input_ids": list(range(1, int(n) + 1)), "sid": i} for i, n in enumerate(lens)]


def _jsonl(tmp_path) -> list[str]:
    data, files = _data(), []
    for j, (a, b) in enumerate(((0, 100), (100, N))):
        f = tmp_path / f"s{j}.jsonl"
        f.write_text("".join(json.dumps(d) + "\n" for d in data[a:b]))
        files.append(str(f))
    return files


def _run(make, world: int, state: dict | None = None, stop: int | None = None, cfg=CFG, window=48):
    samplers = [StreamBatchSampler(make(), cfg, window, rank=r, world_size=world) for r in range(world)]
    for s in samplers:
        if state is not None:
            s.load_state_dict(json.loads(json.dumps(state)))
    its = [iter(s) for s in samplers]
    steps, states = [], []
    while stop is None or len(steps) < stop:
        step = []
        try:
            for r, it in enumerate(its):
                for _ in range(CFG.grad_accum):
                    mb = next(it)
                    if cfg.sources is None:  # the items are the planned samples
                        assert [x["sid"] for x in mb.items] == list(mb)
                    else:  # ids: position * 2 + source; the items say their source and position
                        assert [(x["src"], x["pos"]) for x in mb.items] == [(i % 2, i // 2) for i in mb]
                        assert list(mb.info.sources) == [i % 2 for i in mb]
                    assert [len(x["input_ids"]) for x in mb.items] == list(mb.info.lengths)
                    step.append((r, mb.info.step, list(mb)))
        except StopIteration:
            break
        steps.append(step)
        states.append(samplers[0].state_dict())
    return steps, states


def _ids(*runs) -> list[int]:
    return sorted(i for run in runs for st in run for (_, _, mb) in st for i in mb)


@pytest.mark.parametrize("kind", ["jsonl", "datasets"])
def test_resumed_at_1_2_4_ranks_every_sample_once_and_the_unbroken_steps(tmp_path, kind) -> None:
    files = _jsonl(tmp_path)
    if kind == "jsonl":

        def make():
            return ShardSamples(files)
    else:
        datasets = pytest.importorskip("datasets")

        def make():
            ds = datasets.Dataset.from_list(_data()).to_iterable_dataset(num_shards=3)
            return HFStreamSamples(ds, name="hf")

    whole, _ = _run(make, 1)
    assert _ids(whole) == list(range(N))
    a, sa = _run(make, 1, stop=5)
    assert a == whole[:5]  # the same steps as far as they go
    b, sb = _run(make, 2, sa[-1], stop=4)
    c, _ = _run(make, 4, sb[-1])
    assert _ids(a, b, c) == list(range(N))
    assert [st[0][1] for st in b] == list(range(5, 9))  # steps count on across the resume
    again, _ = _run(make, 4, sb[-1])
    assert again == c  # a resume is the unbroken run from its state
    same, _ = _run(make, 1, sa[-1])
    assert a + same == whole


def test_a_mixture_of_a_shard_stream_and_a_datasets_stream_resumes_at_another_world_size(tmp_path) -> None:
    datasets = pytest.importorskip("datasets")
    data = _data()
    chat = [{**d, "src": 0, "pos": i} for i, d in enumerate(data[:200])]
    code = [{**d, "src": 1, "pos": i} for i, d in enumerate(data[200:])]
    f = tmp_path / "chat.jsonl"
    f.write_text("".join(json.dumps(d) + "\n" for d in chat))
    cfg = CFG.with_(sources=(("chat", 2.0), ("code", 1.0)), unit="documents")

    def make():
        ds = datasets.Dataset.from_list(code).to_iterable_dataset(num_shards=2)
        return {"chat": ShardSamples([f]), "code": HFStreamSamples(ds, name="code")}

    whole, _ = _run(make, 1, cfg=cfg, window=None)
    ids = _ids(whole)
    assert len(ids) == len(set(ids)) and max(i % 2 == 1 for i in ids)
    for st in whole:
        src = [i % 2 for (_, _, mb) in st for i in mb]
        assert abs(src.count(0) - 2 * len(src) / 3) < 1  # every step holds the share within one document
    a, sa = _run(make, 1, stop=6, cfg=cfg, window=None)
    assert a == whole[:6]
    b, sb = _run(make, 2, sa[-1], stop=3, cfg=cfg, window=None)
    c, _ = _run(make, 4, sb[-1], cfg=cfg, window=None)
    got = _ids(a, b, c)
    assert len(got) == len(set(got))
    for s in (0, 1):
        pos = sorted(i // 2 for i in got if i % 2 == s)
        assert pos == list(range(len(pos))) and len(pos) > 20
    assert _run(make, 4, sb[-1], cfg=cfg, window=None)[0] == c
    with pytest.raises(ConfigError, match="a mixture of streams is composed step by step: give window=None"):
        StreamBatchSampler(make(), cfg, 48, rank=0, world_size=1)
    with pytest.raises(ConfigError, match=r"weighted sources stream from a mapping of each source's name"):
        StreamBatchSampler({"chat": ShardSamples([f])}, cfg, None, rank=0, world_size=1)


def test_bad_streams_are_one_line(tmp_path) -> None:
    data = _data()
    it = StreamBatchSampler(IteratorSamples(iter(data), name="tok"), CFG, 48, rank=0, world_size=1)
    state = next(s for _, s in zip(range(3), _states(it)))
    fresh = StreamBatchSampler(IteratorSamples(iter(data), name="tok"), CFG, 48, rank=0, world_size=1)
    with pytest.raises(ConfigError, match=r"^source 'tok' cannot seek \(an iterator\): exact resume") as e:
        fresh.load_state_dict(state)
    assert "\n" not in str(e.value)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match=r"source '.*empty.jsonl': empty \(a source needs at least one"):
        ShardSamples([empty])
    with pytest.raises(ConfigError, match=r"source '.*x.csv': a shard is .parquet or .jsonl"):
        ShardSamples([tmp_path / "x.csv"])
    with pytest.raises(ConfigError, match="at least one shard"):
        ShardSamples([])
    with pytest.raises(ConfigError, match="fewer than two steps"):
        StreamBatchSampler(ShardSamples(_jsonl(tmp_path)), CFG.with_(world_size=4), 10, rank=0, world_size=4)
    datasets = pytest.importorskip("datasets")
    shuffled = datasets.Dataset.from_list(data).to_iterable_dataset().shuffle(seed=0, buffer_size=10)
    s = StreamBatchSampler(HFStreamSamples(shuffled, name="mixed"), CFG, 48, rank=0, world_size=1)
    state = next(x for _, x in zip(range(3), _states(s)))
    again = StreamBatchSampler(HFStreamSamples(shuffled, name="mixed"), CFG, 48, rank=0, world_size=1)
    with pytest.raises(ConfigError, match=r"^source 'mixed' cannot seek \(a shuffle buffer"):
        again.load_state_dict(state)


def _states(sampler):
    for _ in sampler:
        yield sampler.state_dict()


def test_padfree_trainer_trains_a_stream_and_resumes_it(tmp_path) -> None:
    datasets = pytest.importorskip("datasets")
    from transformers import TrainingArguments

    from padfree.hf import PadfreeTrainer
    from padfree.models import build_model
    from padfree.torch.documents.attention import attention_implementation

    tiny = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 2, "vocab_size": 64}  # fmt: skip
    data = [{"input_ids": [min(t, 63) for t in d["input_ids"]]} for d in _data()[:120]]
    seen: list[tuple[int, int]] = []

    def trainer(steps: int) -> PadfreeTrainer:
        from padfree.torch import PackCollator

        collate = PackCollator()

        def logged(items):
            seen.extend((items.info.step, i) for i in items.info.indices)
            return collate(items)

        ds = datasets.Dataset.from_list(data).to_iterable_dataset(num_shards=2)
        model = build_model("tiny-llama", attn_implementation=attention_implementation("packed"), **tiny)
        args = TrainingArguments(str(tmp_path / "out"), gradient_accumulation_steps=2, max_steps=steps,
                                 save_steps=1, report_to=[], use_cpu=True, disable_tqdm=True,
                                 remove_unused_columns=False)  # fmt: skip
        return PadfreeTrainer(model=model, args=args, stream=Stream(HFStreamSamples(ds, name="hf"), 40),
                              plan_config=CFG, collator=logged)  # fmt: skip

    trainer(3).train()
    first = list(seen)
    seen.clear()
    trainer(7).train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    resumed = list(seen)
    seen.clear()
    import shutil

    shutil.rmtree(tmp_path / "out")
    trainer(7).train()
    assert sorted(first + resumed) == sorted(seen)  # the unbroken run's samples, step for step
    assert {s for s, _ in resumed} == {3, 4, 5, 6}
    assert len({i for _, i in seen}) == len(seen)
    with pytest.raises(ConfigError, match="needs TrainingArguments.max_steps > 0"):
        trainer(-1)


def test_padfree_trainer_logs_the_loss_of_each_streamed_source(tmp_path) -> None:
    from transformers import TrainingArguments

    from padfree.hf import PadfreeTrainer
    from padfree.models import build_model
    from padfree.torch.documents.attention import attention_implementation

    tiny = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 2, "vocab_size": 64}  # fmt: skip
    data = [{"input_ids": [min(t, 63) for t in d["input_ids"]]} for d in _data()]
    files = {}
    for name, part in (("chat", data[:150]), ("code", data[150:])):
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(d) + "\n" for d in part))
    cfg = CFG.with_(sources=(("chat", 0.5), ("code", 0.5)), unit="tokens")
    model = build_model("tiny-llama", attn_implementation=attention_implementation("packed"), **tiny)
    args = TrainingArguments(str(tmp_path / "out"), gradient_accumulation_steps=2, max_steps=3,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, remove_unused_columns=False)  # fmt: skip
    stream = Stream({n: ShardSamples([f]) for n, f in files.items()})
    trainer = PadfreeTrainer(model=model, args=args, stream=stream, plan_config=cfg)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3 and all(h["loss_chat"] > 0 and h["loss_code"] > 0 for h in logged)
