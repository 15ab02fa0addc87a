"""User JSONL tasks on tiny random VLMs (LLaVA-OneVision, Qwen2.5-VL) with real images."""

import json

import pytest
import torch

from kvplan.evaluation import evaluate, named_plan, pad_token_id, prepare_samples, user_task_samples

skimage = pytest.importorskip("skimage")

IMAGE_TOKEN = "<image>"


class TinyProcessor:
    """Stands in for a VLM processor offline: the SmolLM2 tokenizer + a real image processor class;
    each image token is expanded to as many tokens as the vision tower yields for that image."""

    def __init__(self, tokenizer, image_processor, image_token_id, count):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token = IMAGE_TOKEN
        self.image_token_id = image_token_id
        self.count = count  # (processor output) -> number of visual tokens per image

    def __call__(self, text, images, return_tensors="pt"):
        enc = self.image_processor(images=images, return_tensors="pt")
        counts = self.count(enc)
        ids = []
        pieces = text[0].split(IMAGE_TOKEN)
        for i, piece in enumerate(pieces):
            if piece:
                ids += self.tokenizer(piece, add_special_tokens=False)["input_ids"]
            if i < len(pieces) - 1:
                ids += [self.image_token_id] * counts[i]
        out = dict(enc)
        out["input_ids"] = torch.tensor([ids])
        if "image_grid_thw" in enc:  # Qwen2.5-VL needs the token types for 3-D positions
            out["mm_token_type_ids"] = (out["input_ids"] == self.image_token_id).int()
        return out


def _write_task(tmp_path):
    from PIL import Image

    paths = []
    for name in ("astronaut", "coffee"):
        p = tmp_path / f"{name}.png"
        Image.fromarray(getattr(skimage.data, name)()).resize((112, 112)).save(p)
        paths.append(p.name)
    recs = [
        {"history": "Two photos: a person in a space suit and a cup of coffee.", "images": paths,
         "question": "What is in the second photo?", "choices": ["coffee", "a dog", "a car", "a tree"],
         "answer": "coffee"},
        {"history": "A photo of an astronaut.", "images": paths[:1], "question": "Who is this?",
         "answer": "an astronaut"},
    ]
    f = tmp_path / "task.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return f


def _text_cfg(vocab, **kw):
    return dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, **kw)


@pytest.fixture(scope="module")
def tok(smol):
    return smol[1]


def _tiny_llava_ov(tok):
    from transformers import (LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration,
                              LlavaOnevisionImageProcessor)

    vocab = len(tok) + 8
    image_id = len(tok) + 1
    cfg = LlavaOnevisionConfig(
        text_config={"model_type": "qwen2", **_text_cfg(vocab)},
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 56, "patch_size": 14},
        image_token_index=image_id, video_token_index=image_id + 1, image_grid_pinpoints=[[56, 56], [56, 112]],
        vision_feature_layer=-1, vision_feature_select_strategy="full")
    torch.manual_seed(0)
    model = LlavaOnevisionForConditionalGeneration(cfg).eval()
    ip = LlavaOnevisionImageProcessor(size={"height": 56, "width": 56}, image_grid_pinpoints=[[56, 56], [56, 112]],
                                      crop_size={"height": 56, "width": 56}, do_pad=True)

    def count(enc):
        with torch.no_grad():
            feats = model.model.get_image_features(pixel_values=enc["pixel_values"], image_sizes=enc["image_sizes"])
        feats = getattr(feats, "pooler_output", feats)
        return [f.shape[0] for f in feats]

    return model, TinyProcessor(tok, ip, image_id, count)


def _tiny_qwen25_vl(tok):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor

    vocab = len(tok) + 8
    image_id = len(tok) + 1
    cfg = Qwen2_5_VLConfig(
        text_config={**_text_cfg(vocab), "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                                            "rope_theta": 10000.0}},
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "fullatt_block_indexes": [0], "window_size": 56},
        image_token_id=image_id, video_token_id=image_id + 1, vision_start_token_id=image_id + 2,
        vision_end_token_id=image_id + 3)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    ip = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, merge_size=2)

    def count(enc):
        return [int(t.prod()) // 4 for t in enc["image_grid_thw"]]

    return model, TinyProcessor(tok, ip, image_id, count)


@pytest.mark.slow
@pytest.mark.parametrize("build", [_tiny_llava_ov, _tiny_qwen25_vl], ids=["llava-onevision", "qwen2.5-vl"])
def test_user_jsonl_task_on_tiny_vlm(tmp_path, tok, build):
    model, proc = build(tok)
    samples = user_task_samples(_write_task(tmp_path), model, proc)
    assert len(samples) == 2
    s0 = samples[0]
    assert s0.history_labels.count("visual") > 0 and s0.history_labels[-1] == "text"
    assert s0.options and s0.answer == 0 and samples[1].options is None
    prepared = prepare_samples(model, samples, pad_id=pad_token_id(proc), progress=False)
    mods = ("text", "visual")
    fp = evaluate(model, named_plan("fp16", model, modalities=mods, residual_length=0), prepared, progress=False)
    assert 0.0 <= fp["kl"]["mean"] < 1e-6  # the deployed (chunked) attention's rounding only
    r = evaluate(model, named_plan("int2", model, modalities=mods, residual_length=0), prepared, progress=False)
    assert r["quantized_tokens"]["k"]["visual"] > 0
    assert r["kl"]["mean"] > 0 and "acc" in r
