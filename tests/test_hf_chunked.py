"""PadfreeTrainer on a chunked plan: one SGD step moves the parameters as training the step's documents
whole (a long document's chunks attend to its earlier chunks), and logs the step's token-mean loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
from conftest import TINY_MODEL  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

from padfree import PlanConfig  # noqa: E402
from padfree.hf import PadfreeTrainer  # noqa: E402
from padfree.models import build_model  # noqa: E402
from padfree.torch import token_loss_sum  # noqa: E402
from padfree.torch.documents.attention import attention_implementation  # noqa: E402

TINY_KW = {**TINY_MODEL, "vocab_size": 64, "num_hidden_layers": 2}
BUDGET = 32


def _model():
    model = build_model("tiny-llama", attn_implementation=attention_implementation("chunked"), **TINY_KW)
    return model.float()


@pytest.mark.parametrize("keep", [0, 1])
def test_one_trainer_step_equals_the_documents_trained_whole(tmp_path, keep):
    rng = np.random.default_rng(0)
    lengths = [3 * BUDGET + 9, 15, 9, 2 * BUDGET + 1, 7]  # 4 + 3 chunks and one packed row: one step
    data = [{"input_ids": rng.integers(1, 64, n)} for n in lengths]
    config = PlanConfig(strategy="chunked", budget=BUDGET, grad_accum=8, seed=0)
    lr = 0.5
    # the reference: every document whole, the step's token mean, one SGD step
    reference = _model()
    tokens = sum(n - 1 for n in lengths)
    total = 0.0
    for d in data:
        ids = torch.as_tensor(d["input_ids"])[None]
        labels = ids.clone()
        labels[0, 0] = -100
        s = token_loss_sum(reference(input_ids=ids).logits, labels)
        (s / tokens).backward()
        total += s.item()
    with torch.no_grad():
        for p in reference.parameters():
            p -= lr * p.grad
    args = TrainingArguments(
        output_dir=str(tmp_path), gradient_accumulation_steps=8, max_steps=1, optim="sgd", learning_rate=lr,
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, remove_unused_columns=False,
        report_to=[], logging_steps=1, save_strategy="no", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    trainer = PadfreeTrainer(
        model=_model(), args=args, train_dataset=data, lengths=lengths, plan_config=config, keep_chunks=keep
    )
    trainer.train()
    assert trainer.padfree_sampler.steps_in_epoch == 1
    got = trainer.model.state_dict()
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-5)
    logged = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    assert logged == pytest.approx(total / tokens, rel=2e-4)
