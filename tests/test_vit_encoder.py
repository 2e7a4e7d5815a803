"""ViT encoders under the Show-Attend-Tell decoder: the project's own ViT (``backbone: vit``) from a `vision-attn
fit` checkpoint or timm-format weights, and timm's ViTs through ``timm:vit_*``; the patch tokens must be the
annotation vectors in image order, so that α_i with i = r·Gw + c is drawn over patch (r, c)."""

from __future__ import annotations

import pytest
import torch

from vision_attn.captioning.captioner import Captioner
from vision_attn.captioning.encoder import AnnotationEncoder
from vision_attn.errors import CheckpointError
from vision_attn.vit.classifier import Classifier
from vision_attn.vit.vision_transformer import VisionTransformer

VOCABULARY = ["<pad>", "<start>", "<end>", "<unk>", "a", "red", "bag"]


def saved_vit(vit_checkpoint) -> VisionTransformer:
    """The ViT inside the fixture's checkpoint (tests/configs/vit_tiny.yaml: 28 px, patch 7, 1 channel)."""
    return Classifier.from_checkpoint(vit_checkpoint).model


def test_the_patch_tokens_are_the_vits_own_in_image_order(vit_checkpoint) -> None:
    """At the ViT's own size, a grey RGB image gives exactly the ViT's final-norm patch tokens (the 1-channel
    patch kernel becomes three thirds), as a row-major grid: no cls token, nothing reordered."""
    vit = saved_vit(vit_checkpoint)
    encoder = AnnotationEncoder(backbone="vit", pretrained=vit_checkpoint, image_size=28).eval()
    grey = torch.randn(2, 1, 28, 28)
    annotations, grid = encoder(grey.expand(-1, 3, -1, -1))
    assert grid == (4, 4) == vit.grid_size and encoder.annotation_dim == vit.embed_dim
    with torch.no_grad():
        tokens = vit.forward_features(grey)[:, vit.num_prefix_tokens :]
    torch.testing.assert_close(annotations, tokens, atol=1e-5, rtol=1e-4)


def test_a_larger_caption_input_resamples_the_position_embedding_and_keeps_the_geometry(vit_checkpoint) -> None:
    """At 56 px the 4x4 grid becomes 8x8 (position embedding resampled), and a patch changed at (r, c) changes
    annotation r·Gw + c before any other: at the embedding alone exactly, and through the trained blocks most."""
    encoder = AnnotationEncoder(backbone="vit", pretrained=vit_checkpoint, image_size=56).eval()
    assert encoder.grid_for(56) == (8, 8)
    assert encoder.trunk[0].pos_embed.shape == (1, 1 + 64, 32)
    image = torch.zeros(1, 3, 56, 56)
    for row, col in ((0, 0), (2, 5), (7, 3)):
        bright = image.clone()
        bright[:, :, row * 7 : row * 7 + 7, col * 7 : col * 7 + 7] = 2.0
        with torch.no_grad():
            embedded = [encoder.trunk[0](x)[:, 1:] for x in (image, bright)]
            changed = (embedded[1] - embedded[0]).norm(dim=-1)[0]
            assert changed.nonzero().flatten().tolist() == [row * 8 + col]
            final = (encoder(bright)[0] - encoder(image)[0]).norm(dim=-1)[0]
        assert final.argmax().item() == row * 8 + col


def test_blocks_are_stages_to_freeze_or_fine_tune_and_to_cache(vit_checkpoint) -> None:
    encoder = AnnotationEncoder(backbone="vit", pretrained=vit_checkpoint, image_size=28, trainable_stages=2)
    trainable = {name.split(".")[1] for name, p in encoder.named_parameters() if p.requires_grad}
    assert trainable == {"2", "3"}  # the last block and the final norm; the embedding and block 1 frozen
    images = torch.randn(2, 3, 28, 28)
    encoder.eval()
    direct, _ = encoder(images)
    with torch.no_grad():
        cached = encoder.frozen_part()(images)
    torch.testing.assert_close(encoder.from_frozen(cached)[0], direct)
    frozen = AnnotationEncoder(backbone="vit", pretrained=vit_checkpoint, image_size=28, trainable_stages=0)
    assert not any(p.requires_grad for p in frozen.parameters())


def test_timm_format_weights_load_and_a_captioner_checkpoint_rebuilds_without_the_file(vit_checkpoint,
                                                                                       tmp_path) -> None:
    """A bare timm-named state dict (no hyper-parameters: heads read as embed_dim / 64, here 1) loads; the
    captioner records the architecture (``vit``), so its checkpoint is rebuilt without the ViT's file."""
    vit = VisionTransformer(img_size=32, patch_size=8, in_chans=3, num_classes=5, embed_dim=64, depth=2,
                            num_heads=1, reg_tokens=2)
    torch.save(vit.state_dict(), tmp_path / "vit_timm.pth")
    encoder = AnnotationEncoder(backbone="vit", pretrained=tmp_path / "vit_timm.pth", image_size=32).eval()
    with torch.no_grad():
        image = torch.randn(1, 3, 32, 32)
        torch.testing.assert_close(encoder(image)[0], vit.forward_features(image)[:, 3:])
    assert encoder.options.vit["reg_tokens"] == 2 and encoder.options.vit["num_heads"] == 1
    decoder = {"embed_dim": 8, "hidden_dim": 8, "attention_dim": 8}
    captioner = Captioner(vocabulary=VOCABULARY, image={"size": 56}, decoder=decoder,
                          encoder={"backbone": "vit", "pretrained": str(vit_checkpoint)})
    rebuilt = Captioner(vocabulary=VOCABULARY, image={"size": 56}, decoder=decoder,
                        encoder={"backbone": "vit", "vit": captioner.encoder.options.vit})
    rebuilt.load_state_dict(captioner.state_dict())
    image = torch.randn(1, 3, 56, 56)
    captioner.eval(), rebuilt.eval()
    assert captioner.decode(image).hypotheses[0].tokens == rebuilt.decode(image).hypotheses[0].tokens


def test_bad_vit_sources_are_one_line_errors(vit_checkpoint, tmp_path) -> None:
    with pytest.raises(ValueError, match="backbone vit needs encoder.pretrained"):
        AnnotationEncoder(backbone="vit")
    torch.save(AnnotationEncoder(backbone="small", width=8).state_dict(), tmp_path / "cnn.pth")
    with pytest.raises(CheckpointError, match="not a ViT checkpoint"):
        AnnotationEncoder(backbone="vit", pretrained=tmp_path / "cnn.pth")
    with pytest.raises(ValueError, match="not a multiple of the ViT's patch size 7"):
        AnnotationEncoder(backbone="vit", pretrained=vit_checkpoint, image_size=30)


def test_timm_vits_give_their_patch_grid_in_image_order() -> None:
    """`timm:vit_tiny_patch16_224` (untrained, no download): a 14x14 grid of 192-dim tokens at 224 px, and a
    patch changed at (r, c) changes annotation r·14 + c the most."""
    encoder = AnnotationEncoder(backbone="timm:vit_tiny_patch16_224").eval()
    image = torch.zeros(1, 3, 224, 224)
    with torch.no_grad():
        annotations, grid = encoder(image)
        assert grid == (14, 14) and annotations.shape == (1, 196, 192)
        bright = image.clone()
        bright[:, :, 16 * 3 : 16 * 4, 16 * 9 : 16 * 10] = 3.0
        changed = (encoder(bright)[0] - annotations).norm(dim=-1)[0]
    assert changed.argmax().item() == 3 * 14 + 9
