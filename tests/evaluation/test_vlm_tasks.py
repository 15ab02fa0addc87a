"""User JSONL tasks on tiny random VLMs (LLaVA-OneVision, Qwen2.5-VL) with real images."""

import json

import pytest
import skimage.data
import torch

from kvplan.evaluation import evaluate, named_plan, pad_token_id, prepare_samples, user_task_samples


def _with_tokens(tok, tokens):
    """A copy of the SmolLM2 tokenizer with a VLM's special tokens added (ids after its vocabulary)."""
    import copy

    t = copy.deepcopy(tok)
    t.add_tokens(list(tokens), special_tokens=True)
    return t


def _write_task(tmp_path):
    from PIL import Image

    paths = []
    for name in ("astronaut", "coffee"):
        p = tmp_path / f"{name}.png"
        Image.fromarray(getattr(skimage.data, name)()).resize((112, 112)).save(p)
        paths.append(p.name)
    frames = []  # a 4-frame "video": the rocket panning right
    rocket = Image.fromarray(skimage.data.rocket()).convert("RGB").resize((224, 112))
    for i in range(4):
        p = tmp_path / f"frame{i}.png"
        rocket.crop((28 * i, 0, 28 * i + 112, 112)).save(p)
        frames.append(p.name)
    recs = [
        {"history": "Two photos: a person in a space suit and a cup of coffee.", "images": paths,
         "question": "What is in the second photo?", "choices": ["coffee", "a dog", "a car", "a tree"],
         "answer": "coffee"},
        {"history": "A photo of an astronaut.", "images": paths[:1], "question": "Who is this?",
         "answer": "an astronaut"},
        {"history": "A short clip of a rocket.", "video": frames, "question": "What moves?", "answer": "a rocket"},
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
    """A tiny random LLaVA-OneVision (Qwen2 decoder, SigLIP tower on 56-px tiles) and its real
    ``LlavaOnevisionProcessor`` (image and video processors as transformers builds them)."""
    from transformers import (LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration,
                              LlavaOnevisionImageProcessor, LlavaOnevisionProcessor, LlavaOnevisionVideoProcessor)

    tok = _with_tokens(tok, ["<image>", "<video>"])
    image_id, video_id = tok.convert_tokens_to_ids(["<image>", "<video>"])
    cfg = LlavaOnevisionConfig(
        text_config={"model_type": "qwen2", **_text_cfg(len(tok))},
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 56, "patch_size": 14},
        image_token_index=image_id, video_token_index=video_id, image_grid_pinpoints=[[56, 56], [56, 112]],
        vision_feature_layer=-1, vision_feature_select_strategy="full")
    torch.manual_seed(0)
    model = LlavaOnevisionForConditionalGeneration(cfg).eval()
    ip = LlavaOnevisionImageProcessor(size={"height": 56, "width": 56}, image_grid_pinpoints=[[56, 56], [56, 112]],
                                      crop_size={"height": 56, "width": 56}, do_pad=True)
    vp = LlavaOnevisionVideoProcessor(size={"height": 56, "width": 56})
    proc = LlavaOnevisionProcessor(image_processor=ip, tokenizer=tok, video_processor=vp, num_image_tokens=16,
                                   vision_feature_select_strategy="full")
    return model, proc


def _tiny_qwen25_vl(tok):
    """A tiny random Qwen2.5-VL (3-D M-RoPE) and its real ``Qwen2_5_VLProcessor``."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                              Qwen2VLImageProcessor, Qwen2VLVideoProcessor)

    tok = _with_tokens(tok, ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])
    image_id, video_id, start_id, end_id = tok.convert_tokens_to_ids(
        ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])
    cfg = Qwen2_5_VLConfig(
        text_config={**_text_cfg(len(tok)), "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                                              "rope_theta": 10000.0}},
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "fullatt_block_indexes": [0], "window_size": 56},
        image_token_id=image_id, video_token_id=video_id, vision_start_token_id=start_id, vision_end_token_id=end_id)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    pixels = dict(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, merge_size=2)
    proc = Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(**pixels), tokenizer=tok,
                               video_processor=Qwen2VLVideoProcessor(**pixels, temporal_patch_size=2))
    return model, proc


@pytest.mark.slow
@pytest.mark.parametrize("build", [_tiny_llava_ov, _tiny_qwen25_vl], ids=["llava-onevision", "qwen2.5-vl"])
def test_user_jsonl_task_on_tiny_vlm(tmp_path, tok, build):
    model, proc = build(tok)
    samples = user_task_samples(_write_task(tmp_path), model, proc)
    assert len(samples) == 3
    s0, clip = samples[0], samples[2]
    assert s0.history_labels.count("visual") > 0 and s0.history_labels[-1] == "text"
    assert s0.options and s0.answer == 0 and samples[1].options is None
    # the clip's tokens are the processor's video tokens, labelled visual like image tokens
    video_id = model.config.video_token_id if hasattr(model.config, "video_token_id") else model.config.video_token_index
    n_video = clip.history_ids.count(video_id)
    assert n_video > 0 and clip.history_labels.count("visual") == n_video
    assert any("video" in k for k in clip.prefill_inputs)
    start = getattr(model.config, "vision_start_token_id", None)  # Qwen-VL: its chat template's brackets
    if start is not None:
        for s, token_id in ((s0, model.config.image_token_id), (clip, video_id)):
            first = s.history_ids.index(token_id)
            last = len(s.history_ids) - 1 - s.history_ids[::-1].index(token_id)
            assert s.history_ids[first - 1] == start and s.history_ids[last + 1] == model.config.vision_end_token_id
    prepared = prepare_samples(model, samples, pad_id=pad_token_id(proc), progress=False)
    mods = ("text", "visual")
    fp = evaluate(model, named_plan("fp16", model, modalities=mods, residual_length=0), prepared, progress=False)
    assert 0.0 <= fp["kl"]["mean"] < 1e-6  # the deployed (chunked) attention's rounding only
    r = evaluate(model, named_plan("int2", model, modalities=mods, residual_length=0), prepared, progress=False)
    assert r["quantized_tokens"]["k"]["visual"] > 0
    assert r["kl"]["mean"] > 0 and "acc" in r


def test_generate_demo_runs_on_a_vlm_with_its_processor(tok, capsys):
    """``kvplan generate --model <VLM>``: the prompt reaches the processor as text (a processor's first
    positional argument is ``images``: the prompt used to be parsed as an image path)."""
    from kvplan.runtime.demo import generate_demo

    model, proc = _tiny_llava_ov(tok)
    result = generate_demo("int4", model=(model, proc), prompt="Hello there", max_new_tokens=3)
    assert result["bpv"] > 0 and "reply:" in capsys.readouterr().out


def test_search_query_pass_runs_on_a_qwen_vl_jsonl_task(tmp_path, tok):
    """The key-correction basis reads each calibration sample's history and continuation in one pass:
    a Qwen2.5-VL prompt's per-token ``mm_token_type_ids`` are extended over the continuation (text), so
    the pass runs (it raised a shape error, which crashed ``kvplan search --task`` on Qwen-VL)."""
    from kvplan.plans import Reference
    from kvplan.search.key_basis import query_second_moments
    from kvplan.search.scorers import HarnessScorer

    model, proc = _tiny_qwen25_vl(tok)
    samples = user_task_samples(_write_task(tmp_path), model, proc)[:1]
    prepared = prepare_samples(model, samples, pad_id=pad_token_id(proc), progress=False)
    scorer = HarnessScorer(model, prepared, Reference(128), ("text", "visual"), "calibration", "h")
    try:
        (seq,) = scorer.calibration_sequences()
        n = len(seq["input_ids"])
        assert all(v.shape[-1] == n for k, v in seq.items() if k.endswith("token_type_ids"))
        assert query_second_moments(model, [seq]).shape[0] == model.config.get_text_config().num_hidden_layers
    finally:
        scorer.close()


def test_a_studys_data_hash_counts_the_pixels_of_its_images():
    """An image's token ids depend only on its size: a study resumed on other images of the same sizes is
    other data, and its hash says so; text samples keep the hash they always had (old studies resume)."""
    import hashlib

    from kvplan.evaluation.harness import Sample
    from kvplan.search.scorers import samples_digest

    text = [Sample([1, 2, 3], ["text"] * 3, [4, 5])]
    assert samples_digest(text) == hashlib.sha256(repr([([1, 2, 3], [4, 5])]).encode()).hexdigest()[:16]
    pixels = torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    labels = ["text", "visual", "visual", "text"]

    def with_image(p):
        return [Sample([1, 9, 9, 3], labels, [4, 5], prefill_inputs={"pixel_values": p})]

    assert samples_digest(with_image(pixels)) != samples_digest(with_image(1 - pixels)) != samples_digest(text)
    assert samples_digest(with_image(pixels)) == samples_digest(with_image(pixels.clone()))


def test_a_record_whose_media_fail_once_read_names_the_task_file_line_and_field(tmp_path):
    """An image that does not decode, a clip of frames of two sizes, images for a model without an image
    token: these show only once the media are read, and said "record 4 (line 5)", naming neither the task
    file nor the field (the checks before any model loads say ``file:line: field '...'``)."""
    import types

    from PIL import Image

    from kvplan.evaluation.tasks import TaskError, encode_user_record, read_jsonl

    (tmp_path / "broken.png").write_bytes(b"not an image")
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    Image.new("RGB", (16, 8)).save(tmp_path / "b.png")
    task = tmp_path / "task.jsonl"
    task.write_text("".join(json.dumps(r) + "\n" for r in [
        {"history": "h", "question": "q", "images": ["broken.png"]},
        {"history": "h", "question": "q", "video": ["a.png", "b.png"]},
        {"history": "h", "question": "q", "images": ["a.png"]}]))
    broken, clip, image = read_jsonl(task)
    model = types.SimpleNamespace(config=types.SimpleNamespace())
    processor = types.SimpleNamespace(video_token="<video>")  # no image token
    with pytest.raises(TaskError, match=rf"^{task}:1: field 'images': cannot read image {tmp_path / 'broken.png'}"):
        encode_user_record(broken, model, processor)
    with pytest.raises(TaskError, match=rf"^{task}:2: field 'video': the clip's frames must share one size"):
        encode_user_record(clip, model, processor)
    with pytest.raises(TaskError, match=rf"^{task}:3: field 'images': the model's processor has no image token"):
        encode_user_record(image, model, processor)
