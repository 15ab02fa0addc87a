"""Tiny random-weight models built offline from configs (no hub access)."""

from __future__ import annotations

import torch

IMAGE_TOKEN = 250
VIDEO_TOKEN = 251


def tiny_llama(num_layers=2, num_kv_heads=2, head_dim=16, sliding_window=None, model_type="llama", seed=0):
    import transformers

    cls_cfg = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config}[model_type]
    kwargs = dict(vocab_size=256, hidden_size=num_kv_heads * 2 * head_dim, intermediate_size=64,
                  num_hidden_layers=num_layers, num_attention_heads=num_kv_heads * 2,
                  num_key_value_heads=num_kv_heads, head_dim=head_dim, max_position_embeddings=4096,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if sliding_window:
        kwargs["sliding_window"] = sliding_window
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cls_cfg(**kwargs)).eval()


def tiny_gemma3(num_layers=6, num_kv_heads=2, head_dim=16, sliding_window=16, seed=0):
    """Tiny random Gemma 3 text model: 5 sliding-window layers : 1 full layer (transformers'
    default pattern), two RoPE bases (10k local, 1M global), as Gemma-3-270M."""
    import transformers

    cfg = transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=num_kv_heads * 2 * head_dim, intermediate_size=64, num_hidden_layers=num_layers,
        num_attention_heads=num_kv_heads * 2, num_key_value_heads=num_kv_heads, head_dim=head_dim,
        sliding_window=sliding_window, max_position_embeddings=4096, query_pre_attn_scalar=head_dim,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def tiny_gemma3_vl(seed=0, sliding_window=16):
    """Tiny random Gemma 3 VLM (SigLIP tower on 32-px images, 4 tokens per image): its image tokens
    attend to each other both ways in the prefill."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    cfg = Gemma3Config(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=sliding_window,
                         max_position_embeddings=4096, query_pre_attn_scalar=16, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8),
        mm_tokens_per_image=4, image_token_index=IMAGE_TOKEN, boi_token_index=252, eoi_token_index=253)
    torch.manual_seed(seed)
    return Gemma3ForConditionalGeneration(cfg).eval()


def gemma3_vl_inputs(model, n_images=1, before=tuple(range(3, 20)), after=tuple(range(20, 40))):
    """``generate`` inputs for :func:`tiny_gemma3_vl`: text, ``n_images`` random images (each between
    its begin/end-of-image tokens, then two text tokens), text."""
    ids = list(before)
    for _ in range(n_images):
        ids += [252] + [IMAGE_TOKEN] * model.config.mm_tokens_per_image + [253, 10, 11]
    ids = torch.tensor([ids + list(after)])
    pixels = torch.randn(n_images, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels,
            "token_type_ids": (ids == IMAGE_TOKEN).long()}


def tiny_llava_onevision(seed=0):
    """Tiny LLaVA-OneVision; one 32x32 image (anyres, 2 patches) -> 36 visual tokens."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    cfg = LlavaOnevisionConfig(
        text_config=dict(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=4096),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8),
        image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_feature_layer=-1,
        image_grid_pinpoints=[[32, 32]],
    )
    torch.manual_seed(seed)
    return LlavaOnevisionForConditionalGeneration(cfg).eval()


def llava_onevision_inputs(model, image, text_before=(1, 2, 3), text_after=(4, 5, 6)):
    """``input_ids`` + 5-D ``pixel_values`` for one RGB ``image`` (H, W, 3 uint8)."""
    x = torch.tensor(image, dtype=torch.float32).permute(2, 0, 1)[None] / 255.0
    x = torch.nn.functional.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)[0]
    pixel_values = torch.stack([x, x])[None]  # [1, 2 patches, 3, 32, 32]
    image_sizes = torch.tensor([[32, 32]])
    n = sum(f.shape[0] for f in model.model.get_image_features(
        pixel_values=pixel_values, image_sizes=image_sizes).pooler_output)
    ids = torch.tensor([list(text_before) + [IMAGE_TOKEN] * n + list(text_after)])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixel_values,
            "image_sizes": image_sizes}


def tiny_qwen2_5_vl(seed=0):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0],
                           window_size=16),
        image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=252, vision_end_token_id=253,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(cfg).eval()


def qwen2_5_vl_inputs(image, side=32, text_before=(1, 2, 3), text_after=(4, 5, 6)):
    """Qwen2.5-VL inputs for one image resized to ``side``: flattened patches + grid."""
    patch, temporal, merge = 4, 2, 2
    x = torch.tensor(image, dtype=torch.float32).permute(2, 0, 1)[None] / 255.0
    x = torch.nn.functional.interpolate(x, size=(side, side), mode="bilinear", align_corners=False)[0]
    g = side // patch
    frames = torch.stack([x] * temporal)  # [T, C, H, W]
    p = frames.reshape(temporal, 3, g // merge, merge, patch, g // merge, merge, patch)
    p = p.permute(2, 5, 3, 6, 1, 0, 4, 7).reshape(g * g, 3 * temporal * patch * patch)
    n_tokens = g * g // (merge * merge)
    ids = list(text_before) + [252] + [IMAGE_TOKEN] * n_tokens + [253] + list(text_after)
    input_ids = torch.tensor([ids])
    mm = (input_ids == IMAGE_TOKEN).long()
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "pixel_values": p,
            "image_grid_thw": torch.tensor([[1, g, g]]), "mm_token_type_ids": mm}
