"""Two CPU processes (gloo) through the real console script give what one process gives."""

from __future__ import annotations

import csv

import pytest

from tests.conftest import printed_metrics, run_in_process, run_script, tiny

DDP = ("--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu")


@pytest.mark.heavy
def test_a_two_process_fit_checkpoints_once_and_validates_an_odd_sized_split_as_one_process(tmp_path) -> None:
    """A ViT fit on two processes (one epoch of 4 steps, then validation): one writer of the checkpoints, and its
    validation accuracy on 999 images, shards of 500 and 499, is exactly one process's on the checkpoint it wrote
    (padding the shorter shard with a repeated image would change it)."""
    run = tmp_path / "run"
    odd = ["--data.init_args.val_size", "999", "--data.init_args.loader.eval_batch_size", "100",
           "--trainer.limit_val_batches", "1.0"]
    result = run_script("fit", *tiny("vit_tiny.yaml"), *DDP, *odd, "--trainer.default_root_dir", str(run),
                        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir",
                        str(run))
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoints = sorted(path.name for path in run.rglob("*.ckpt"))
    assert checkpoints == ["best.ckpt", "last.ckpt"]  # one writer (rank 0): no best-v1.ckpt, no torn copies
    assert not list(run.rglob(".*.tmp"))
    [logged] = [row for row in csv.DictReader(next(run.rglob("metrics.csv")).open()) if row.get("val/acc")]
    one = run_in_process("validate", *tiny("vit_tiny.yaml"), *odd, "--ckpt_path", str(next(run.rglob("last.ckpt"))),
                         "--trainer.default_root_dir", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-3000:]
    accuracy = float(printed_metrics(one.stdout, "val")["val/acc"])
    assert abs(accuracy * 999 - round(accuracy * 999)) < 1e-3  # a count of 999 images ...
    assert float(logged["val/acc"]) == pytest.approx(accuracy, abs=1e-7)  # ... the same ones on two ranks


def test_a_finished_run_ends_its_process_group_on_each_rank(tmp_path) -> None:
    """``run_lightning`` ends the process group a finished DDP run leaves (Lightning does not): left to the
    interpreter's shutdown, Gloo's threads once aborted a two-process ``predict`` that had succeeded. Here a real
    one-rank Gloo group, ended, and the call is harmless where no group exists."""
    import torch.distributed as dist

    from vision_attn.trainer_cli import end_process_group

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert dist.is_initialized()
        end_process_group()
        assert not dist.is_initialized()
        end_process_group()  # nothing to end: no error
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _fast_lstm_rank(rank: int, store: str, annotations, captions, out: str) -> None:
    # One rank of a two-process DDP step of a decoder whose teacher-forced loop takes fast_lstm (any weight size)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from vision_attn.captioning import fast_lstm
    from vision_attn.captioning.decoder import AttentionDecoder
    from vision_attn.captioning.likelihood import token_likelihood

    fast_lstm.LARGE_WEIGHT = 0
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        decoder = AttentionDecoder(vocab_size=12, annotation_dim=8, embed_dim=6, hidden_dim=10, attention_dim=7,
                                   dropout=0.0)
        model = DistributedDataParallel(decoder)
        half = slice(rank * 2, rank * 2 + 2)
        token_likelihood(model(annotations[half], captions[half]).logits, captions[half]).per_caption.mean().backward()
        if rank == 0:
            torch.save({name: p.grad for name, p in decoder.named_parameters()}, out)
    finally:
        dist.destroy_process_group()


def test_the_fast_teacher_forced_lstm_gives_ddp_the_gradients_one_process_gives(tmp_path) -> None:
    """The faster LSTM hands its weights their gradient once, at the end of backward: DDP still averages every
    gradient across two gloo processes into what one process gets from the whole batch."""
    import torch
    import torch.multiprocessing as mp

    from vision_attn.captioning import fast_lstm
    from vision_attn.captioning.decoder import AttentionDecoder
    from vision_attn.captioning.likelihood import token_likelihood

    generator = torch.Generator().manual_seed(1)
    annotations = torch.randn(4, 9, 8, generator=generator)
    captions = torch.tensor([[1, 5, 6, 7, 2, 0], [1, 8, 2, 0, 0, 0], [1, 9, 10, 2, 0, 0], [1, 4, 4, 11, 6, 2]])
    out = tmp_path / "grads.pt"
    mp.spawn(_fast_lstm_rank, args=(str(tmp_path / "store"), annotations, captions, str(out)), nprocs=2)
    torch.manual_seed(0)
    decoder = AttentionDecoder(vocab_size=12, annotation_dim=8, embed_dim=6, hidden_dim=10, attention_dim=7,
                               dropout=0.0)
    assert not fast_lstm.applies(decoder.embedding(captions), decoder.lstm)  # here nn.LSTMCell: the reference
    halves = [token_likelihood(decoder(annotations[i : i + 2], captions[i : i + 2]).logits, captions[i : i + 2])
              for i in (0, 2)]
    ((halves[0].per_caption.mean() + halves[1].per_caption.mean()) / 2).backward()
    distributed = torch.load(out, weights_only=True)
    for name, parameter in decoder.named_parameters():
        if name != "attention.score.bias":  # softmax ignores it: its gradient is rounding alone
            torch.testing.assert_close(distributed[name], parameter.grad, atol=1e-6, rtol=1e-5, msg=name)
