"""The ViT equals timm's VisionTransformer, returns attention on request, and loads local weights."""

from __future__ import annotations

import pickle

import pytest
import timm
import torch
from safetensors.torch import save_file
from timm.layers import resample_abs_pos_embed

from vision_attn.checkpoint import CheckpointError, load_file
from vision_attn.vit.pretrained import load_pretrained, resample_pos_embed
from vision_attn.vit.vision_transformer import VisionTransformer, patch_dropout, scaled_dot_product_attention

TINY = dict(embed_dim=192, depth=12, num_heads=3, patch_size=16)


@pytest.fixture(scope="module")
def timm_tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10).eval()


@pytest.mark.parametrize(("global_pool", "reg_tokens", "size"), [("token", 0, 224), ("avg", 0, 224), ("token", 4, 64)])
def test_state_dict_and_logits_equal_timm(global_pool: str, reg_tokens: int, size: int) -> None:
    """Also with registers: timm's ``reg_tokens``, the same parameter names, shapes and token order."""
    torch.manual_seed(0)
    theirs = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, global_pool=global_pool,
                               reg_tokens=reg_tokens, img_size=size).eval()
    model = VisionTransformer(img_size=size, in_chans=3, num_classes=10, global_pool=global_pool,
                              reg_tokens=reg_tokens, **TINY).eval()
    ours_state, theirs_state = model.state_dict(), theirs.state_dict()
    assert list(ours_state) == list(theirs_state)
    assert all(ours_state[k].shape == theirs_state[k].shape for k in ours_state)
    model.load_state_dict(theirs_state)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(model(x), theirs(x), atol=1e-5)
        assert torch.allclose(model.forward_features(x), theirs.forward_features(x), atol=1e-5)


def test_attention_weights_are_opt_in_and_match_the_fused_path() -> None:
    torch.manual_seed(0)
    model = VisionTransformer(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=32, depth=3,
                              num_heads=4).eval()
    x = torch.randn(5, 1, 28, 28)
    with torch.no_grad():
        fused = model(x)
        explicit, attentions = model.forward_with_attention(x)
    assert isinstance(fused, torch.Tensor)
    assert torch.allclose(fused, explicit, atol=1e-5)
    assert len(attentions) == 3
    assert attentions[0].shape == (5, 4, 50, 50)  # (B, heads, 1 + 7·7, 1 + 7·7)
    assert torch.allclose(attentions[-1].sum(-1), torch.ones(5, 4, 50))


def test_unfused_attention_trains_like_the_fused_kernel() -> None:
    torch.manual_seed(0)
    fused = VisionTransformer(img_size=28, patch_size=7, in_chans=1, num_classes=10, embed_dim=32, depth=2,
                              num_heads=4)
    explicit = VisionTransformer(img_size=28, patch_size=7, in_chans=1, num_classes=10, embed_dim=32, depth=2,
                                 num_heads=4, fused_attention=False)
    explicit.load_state_dict(fused.state_dict())
    x, y = torch.randn(6, 1, 28, 28), torch.randint(0, 10, (6,))
    gradients = []
    for model in (fused, explicit):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        gradients.append(torch.autograd.grad(loss, list(model.parameters())))
    for a, b in zip(*gradients, strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    assert explicit.forward_with_attention(x)[1][0].shape == (6, 4, 17, 17)


def test_patch_dropout_keeps_the_cls_token_and_a_random_subset_of_patches() -> None:
    torch.manual_seed(0)
    tokens = torch.arange(4 * 17 * 3, dtype=torch.float32).view(4, 17, 3)  # every token is distinct
    kept = patch_dropout(tokens, 0.5, training=True)
    assert kept.shape == (4, 1 + 8, 3)  # int(16 · 0.5) patches survive
    assert torch.equal(kept[:, 0], tokens[:, 0])
    for image in range(4):
        rows = {tuple(row.tolist()) for row in kept[image, 1:]}
        assert len(rows) == 8 and rows <= {tuple(row.tolist()) for row in tokens[image, 1:]}
    chosen = [(kept[image, 1:, 0] - tokens[image, 1, 0]).div(3).tolist() for image in range(4)]
    assert len({tuple(sorted(indices)) for indices in chosen}) > 1  # a different subset per image
    assert patch_dropout(tokens, 0.5, training=False) is tokens
    assert patch_dropout(tokens, 0.99, training=True).shape == (4, 2, 3)  # at least one patch
    # which patches each image kept: the indices name the kept rows, in order
    kept, indices = patch_dropout(tokens, 0.5, training=True, return_indices=True)
    assert indices.shape == (4, 8)
    assert torch.equal(kept[:, 1:], tokens[:, 1:].gather(1, indices.unsqueeze(-1).expand(-1, -1, 3)))
    assert patch_dropout(tokens, 0.5, training=False, return_indices=True)[1] is None


def test_patch_dropout_trains_on_fewer_tokens_and_evaluates_on_all() -> None:
    torch.manual_seed(0)
    plain = VisionTransformer(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=32, depth=2,
                              num_heads=4)
    dropping = VisionTransformer(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=32, depth=2,
                                 num_heads=4, patch_drop_rate=0.5)
    dropping.load_state_dict(plain.state_dict())  # the same parameters: the rate changes training only
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        assert torch.equal(dropping.eval()(x), plain.eval()(x))
        dropping.train()
        assert dropping.forward_features(x).shape == (3, 1 + 24, 32)  # 24 of the 49 patches
        assert not torch.allclose(dropping(x), plain.train()(x))
    with pytest.raises(ValueError, match="patch_drop_rate"):
        VisionTransformer(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=32, depth=1,
                          num_heads=4, patch_drop_rate=1.0)


def test_channels_last_computes_what_the_default_layout_does() -> None:
    """``channels_last`` only lays the patch embedding's tensors out as NHWC: the same weights give the same
    tokens and logits, for the conv stem and the patch conv."""
    for stem in ("conv", "patch"):
        torch.manual_seed(0)
        options = dict(img_size=56, patch_size=8, in_chans=1, num_classes=10, embed_dim=32, depth=1, num_heads=2,
                       stem=stem)
        plain, fast = VisionTransformer(**options).eval(), VisionTransformer(**options, channels_last=True).eval()
        fast.load_state_dict(plain.state_dict())
        convolution = next(m for m in fast.patch_embed.proj.modules() if isinstance(m, torch.nn.Conv2d))
        assert convolution.weight.is_contiguous(memory_format=torch.channels_last)
        x = torch.randn(3, 1, 56, 56)
        with torch.no_grad():
            torch.testing.assert_close(fast(x), plain(x), rtol=1e-5, atol=1e-5)


def test_a_window_takes_the_position_embeddings_of_its_place() -> None:
    """A patch-aligned window of a 56x56 image at (x 8, y 16): with the one-conv patch embedding its tokens are
    exactly the full image's tokens of those patches, position embeddings included; misaligned or overhanging
    windows are refused."""
    torch.manual_seed(0)
    model = VisionTransformer(img_size=56, patch_size=8, in_chans=1, num_classes=10, embed_dim=32, depth=1,
                              num_heads=2, reg_tokens=2)
    image = torch.randn(2, 1, 56, 56)
    window = image[:, :, 16:56, 8:48]  # rows 2..6, columns 1..5 of the 7x7 patch grid
    origin = torch.tensor([[8, 16], [8, 16]])
    full = model.patch_embed(image) + model.pos_embed[:, 3:]  # (B, 49, D), past cls and the 2 registers
    windowed = model.patch_embed(window, window=True) + model.window_position_embedding(origin, (5, 5))[:, 3:]
    torch.testing.assert_close(windowed, full.view(2, 7, 7, 32)[:, 2:7, 1:6].reshape(2, 25, 32), rtol=0, atol=0)
    torch.testing.assert_close(model.window_position_embedding(origin, (5, 5))[:, :3],
                               model.pos_embed[:, :3].expand(2, -1, -1))
    assert model.forward_features(window, window_origin=origin).shape == (2, 3 + 25, 32)
    with pytest.raises(ValueError, match="multiples of the patch size"):
        model.forward_features(window, window_origin=torch.tensor([[4, 16], [8, 16]]))
    with pytest.raises(ValueError, match="leaves the 7x7 grid"):
        model.forward_features(window, window_origin=torch.tensor([[24, 16], [8, 16]]))
    with pytest.raises(ValueError, match="does not fit"):
        model.forward_features(torch.randn(2, 1, 44, 40), window_origin=origin)


def test_explicit_attention_is_softmax_qk_over_sqrt_d() -> None:
    q, k, v = torch.randn(3, 2, 2, 6, 8).unbind(0)
    out, weights = scaled_dot_product_attention(q, k, v, return_weights=True)
    expected = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, dim=-1)
    assert torch.allclose(weights, expected, atol=1e-6)
    assert torch.allclose(out, expected @ v, atol=1e-6)


def test_forward_head_pre_logits_and_no_weight_decay() -> None:
    model = VisionTransformer(img_size=32, patch_size=8, in_chans=3, num_classes=7, embed_dim=16, depth=1,
                              num_heads=2)
    tokens = model.forward_features(torch.randn(2, 3, 32, 32))
    assert tokens.shape == (2, 17, 16)
    assert model.forward_head(tokens, pre_logits=True).shape == (2, 16)
    assert model.forward_head(tokens).shape == (2, 7)
    assert model.no_weight_decay() == {"pos_embed", "cls_token"}


def test_wrong_input_size_is_a_clear_error() -> None:
    model = VisionTransformer(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=16, depth=1,
                              num_heads=2)
    with pytest.raises(ValueError, match="expects 28x28"):
        model(torch.randn(1, 1, 32, 32))


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_load_local_weights_with_new_classes_and_grey_input(timm_tiny, tmp_path, suffix) -> None:
    path = tmp_path / f"vit_tiny{suffix}"
    state = {k: v.contiguous() for k, v in timm_tiny.state_dict().items()}
    save_file(state, str(path)) if suffix == ".safetensors" else torch.save(state, path)
    model = VisionTransformer(img_size=224, in_chans=1, num_classes=5, **TINY).eval()
    fresh = load_pretrained(model, path)
    assert fresh == ["head.weight", "head.bias"]
    grey = torch.randn(2, 1, 224, 224)
    with torch.no_grad():
        ours = model.forward_head(model.forward_features(grey), pre_logits=True)
        theirs = timm_tiny.forward_head(timm_tiny.forward_features(grey.repeat(1, 3, 1, 1)), pre_logits=True)
    assert torch.allclose(ours, theirs, atol=1e-4)  # summed kernel on grey == RGB kernel on grey×3


def test_load_local_weights_resamples_position_embedding(timm_tiny, tmp_path) -> None:
    path = tmp_path / "vit.pth"
    torch.save(timm_tiny.state_dict(), path)
    model = VisionTransformer(img_size=128, in_chans=3, num_classes=10, **TINY)
    load_pretrained(model, path)
    expected = resample_abs_pos_embed(timm_tiny.pos_embed.detach(), new_size=(8, 8), num_prefix_tokens=1)
    assert model.pos_embed.shape == (1, 65, 192)
    assert torch.allclose(model.pos_embed.detach(), expected, atol=1e-5)
    assert torch.equal(resample_pos_embed(timm_tiny.pos_embed, (14, 14)), timm_tiny.pos_embed)


def test_lightning_checkpoint_weights_load_into_a_bare_model(tmp_path) -> None:
    source = VisionTransformer(img_size=28, patch_size=7, in_chans=1, num_classes=10, embed_dim=16, depth=1,
                               num_heads=2)
    torch.save({"state_dict": {f"model.{k}": v for k, v in source.state_dict().items()}, "epoch": 3},
               tmp_path / "run.ckpt")
    target = VisionTransformer(img_size=28, patch_size=7, in_chans=1, num_classes=10, embed_dim=16, depth=1,
                               num_heads=2)
    assert load_pretrained(target, tmp_path / "run.ckpt") == []
    pairs = zip(source.state_dict().values(), target.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_mismatched_architecture_is_refused_with_the_offending_key(timm_tiny, tmp_path) -> None:
    torch.save(timm_tiny.state_dict(), tmp_path / "tiny.pth")
    model = VisionTransformer(img_size=224, in_chans=3, num_classes=10, embed_dim=96, depth=12, num_heads=3)
    with pytest.raises(CheckpointError, match="do not fit this ViT"):
        load_pretrained(model, tmp_path / "tiny.pth")


class _Payload:
    def __reduce__(self):
        return (print, ("payload ran",))


def test_pickled_code_in_a_weights_file_is_refused(tmp_path) -> None:
    path = tmp_path / "evil.pth"
    with open(path, "wb") as file:
        pickle.dump({"weight": _Payload()}, file)
    with pytest.raises(CheckpointError, match="refused"):
        load_file(path)


def test_conv_stem_gives_the_same_grid_and_each_token_sees_its_own_patch() -> None:
    model = VisionTransformer(img_size=56, patch_size=8, in_chans=1, num_classes=10, embed_dim=32, depth=1,
                              num_heads=2, stem="conv").eval()
    assert model.grid_size == (7, 7)
    strides = [m.stride for m in model.patch_embed.proj if isinstance(m, torch.nn.Conv2d)]
    assert strides == [(2, 2), (2, 2), (2, 2), (1, 1)]  # log2(8) stride-2 convs, then the 1x1 projection
    # each token's receptive field is centred on its own patch: the pixels that reach token (3, 5) are centred
    # on patch (3, 5), so maps drawn on the patch grid are where the model looked
    weights = torch.ones(1, 1, 56, 56, requires_grad=True)
    model.patch_embed(weights)[0, 3 * 7 + 5].sum().backward()
    reach = weights.grad[0, 0].abs() > 0
    rows, cols = torch.nonzero(reach).T
    assert (rows.min() + rows.max()) / 2 == 8 * 3 + 3.5 and (cols.min() + cols.max()) / 2 == 8 * 5 + 3.5
    assert model(torch.randn(2, 1, 56, 56)).shape == (2, 10)
    with pytest.raises(ValueError, match="power of 2"):
        VisionTransformer(img_size=56, patch_size=7, in_chans=1, num_classes=10, embed_dim=32, depth=1,
                          num_heads=2, stem="conv")


def test_registers_stay_out_of_the_maps() -> None:
    from vision_attn.vit.rollout import class_map, explain

    torch.manual_seed(0)
    model = VisionTransformer(img_size=64, in_chans=3, num_classes=10, reg_tokens=4, **TINY).eval()
    assert model.num_prefix_tokens == 5 and "reg_token" in model.no_weight_decay()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    maps = explain(model, x, gradient_class=3)
    assert maps.rollout.shape == maps.gradient_rollout.shape == (2, 4, 4) and maps.heads.shape == (2, 3, 4, 4)
    # the cls row's weight on the registers is left out: only the 16 patch columns make the map
    matrix = torch.zeros(1, 21, 21)
    matrix[0, 0, 1:5] = 1.0  # all on the registers
    matrix[0, 0, 5 + 6] = 0.5  # and some on patch (1, 2)
    expected = torch.zeros(1, 4, 4)
    expected[0, 1, 2] = 0.5
    assert torch.equal(class_map(matrix, (4, 4), "token", prefix_tokens=5), expected)


def test_patch_dropout_schedule_goes_from_its_start_to_its_end_rate_over_training(tmp_path) -> None:
    """patch_drop_rate_end: the rate moves linearly over the run's steps (here 5), so each step trains on more
    of the 49 patch tokens: int(49 (1 - p_k)) with p_k = 0.8 + (0.2 - 0.8) k / 5."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from vision_attn.tasks import ViTTask

    module = ViTTask(image={"size": 28, "channels": 1}, architecture={"patch_size": 4, "embed_dim": 32, "depth": 1,
                                                                      "num_heads": 2},
                     training={"patch_drop_rate": 0.8, "patch_drop_rate_end": 0.2}, schedule={"warmup_epochs": 0.0},
                     log_overlays=0)
    seen: list[int] = []
    module.model.blocks[0].register_forward_hook(lambda block, args, out: seen.append(args[0].shape[1] - 1))
    data = TensorDataset(torch.randn(40, 1, 28, 28), torch.randint(0, 10, (40,)))
    trainer = L.Trainer(max_steps=5, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(data, batch_size=8))
    assert seen == [int(49 * (1 - (0.8 - 0.6 * k / 5))) for k in range(5)] == [9, 15, 21, 27, 33]
    with pytest.raises(ValueError, match="training.patch_drop_rate_end must be in"):
        ViTTask(training={"patch_drop_rate_end": 1.0})


def test_distillation_token_state_dict_and_logits_equal_timm_deit() -> None:
    """dist_token: timm's DeiT (VisionTransformerDistilled): the same parameters, token order and logits (the two
    heads' mean in eval; both heads in distilled training)."""
    torch.manual_seed(0)
    theirs = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, num_classes=10, img_size=64).eval()
    model = VisionTransformer(img_size=64, in_chans=3, num_classes=10, dist_token=True, **TINY).eval()
    ours_state, theirs_state = model.state_dict(), theirs.state_dict()
    assert sorted(ours_state) == sorted(theirs_state) and model.num_prefix_tokens == 2
    model.load_state_dict(theirs_state)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(model(x), theirs(x), atol=1e-5)
        theirs.set_distilled_training(True)
        model.distilled_training = True
        theirs.train(), model.train()
        (ours_cls, ours_dist), (their_cls, their_dist) = model(x), theirs(x)
        assert torch.allclose(ours_cls, their_cls, atol=1e-5) and torch.allclose(ours_dist, their_dist, atol=1e-5)
        assert not torch.allclose(ours_cls, ours_dist)
