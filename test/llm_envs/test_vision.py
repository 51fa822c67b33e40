"""The offline tiny VLMs, and M-RoPE positions computed without the model: equal to transformers' get_rope_index, and
a KV-cache loop fed them (prefill with the images, then one token per step at length + rope delta) scores its tokens
as teacher forcing of the whole sequence does."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from tokengym.llm_envs.tiny_vl_models import (
    ImageOnlyQwen2VLProcessor,
    tiny_vl_model,
    tiny_vl_processor,
    tiny_vl_tokenizer,
)
from tokengym.llm_envs.vision import is_vision_model, mrope_positions, vision_token_ids
from tokengym.testing import tiny_model, tiny_tokenizer

IMAGES = {0: [], 1: [(32, 24)], 2: [(16, 40), (48, 32)]}  # images per row: their sizes (w, h)


@pytest.fixture(scope="module")
def tok():
    return tiny_vl_tokenizer()


def _encode(processor, sizes, text="1+1="):
    images = [Image.new("RGB", size, (40 * i, 200, 90)) for i, size in enumerate(sizes)]
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=False)  # fmt: skip
    return processor(text=[prompt], images=images or None, return_tensors="pt")


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("n_images", sorted(IMAGES))
def test_mrope_positions_are_transformers_get_rope_index(tok, family, n_images):
    model, processor = tiny_vl_model(tok, family=family), tiny_vl_processor(tok)
    enc = _encode(processor, IMAGES[n_images])
    ids, grid = enc["input_ids"], enc.get("image_grid_thw")
    types = (ids == model.config.image_token_id).long()
    want, want_delta = model.model.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=grid)
    got, delta = mrope_positions(ids[0], grid, image_token_id=model.config.image_token_id,
                                 merge_size=model.config.vision_config.spatial_merge_size)  # fmt: skip
    assert torch.equal(got, want[:, 0])
    assert delta == int(want_delta.reshape(-1)[0])
    assert (delta < 0) == (n_images > 0)


def test_mrope_positions_refuse_ids_and_grids_that_disagree(tok):
    model, enc = tiny_vl_model(tok), _encode(tiny_vl_processor(tok), IMAGES[1])
    image = model.config.image_token_id
    with pytest.raises(ValueError, match=r"more images in the ids than the 0 grid"):
        mrope_positions(enc["input_ids"][0], None, image_token_id=image, merge_size=2)
    with pytest.raises(ValueError, match=r"image 0 has a \(1, 6, 8\) grid, 48 tokens at merge size 1, but its run"):
        mrope_positions(enc["input_ids"][0], enc["image_grid_thw"], image_token_id=image, merge_size=1)
    with pytest.raises(ValueError, match=r"2 image grid\(s\) given but 1 image"):
        mrope_positions(enc["input_ids"][0], enc["image_grid_thw"].repeat(2, 1), image_token_id=image, merge_size=2)


@pytest.mark.parametrize("n_images", [1, 2])
def test_a_kv_cache_loop_on_these_positions_equals_teacher_forcing(tok, n_images):
    """Prefill with the images and mrope_positions, then each sampled token at (length + delta) in all three
    sections, no images: the sampled tokens' log-probs equal one forward over the whole sequence (float32)."""
    model, processor = tiny_vl_model(tok), tiny_vl_processor(tok)
    enc = _encode(processor, IMAGES[n_images])
    ids, grid, pixels = enc["input_ids"], enc["image_grid_thw"], enc["pixel_values"]
    positions, delta = mrope_positions(ids[0], grid, image_token_id=model.config.image_token_id, merge_size=2)
    banned = torch.tensor(vision_token_ids(model))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        out = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, position_ids=positions[:, None],
                    use_cache=True)  # fmt: skip
        cache, logits, sampled, stepwise = out.past_key_values, out.logits[:, -1], [], []
        for _ in range(8):
            logp = logits.float().index_fill(-1, banned, -float("inf")).log_softmax(-1)
            token = torch.multinomial(logp.exp(), 1, generator=gen)
            sampled.append(int(token)), stepwise.append(float(logp[0, token]))
            at = torch.full((3, 1, 1), ids.shape[1] + len(sampled) - 1 + delta)
            out = model(input_ids=token, position_ids=at, past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1]
        full = torch.cat([ids, torch.tensor([sampled])], 1)
        whole, _ = mrope_positions(full[0], grid, image_token_id=model.config.image_token_id, merge_size=2)
        forced = model(input_ids=full, pixel_values=pixels, image_grid_thw=grid, position_ids=whole[:, None]).logits
        forced = forced[0, ids.shape[1] - 1 : -1].float().index_fill(-1, banned, -float("inf")).log_softmax(-1)
        teacher = forced.gather(-1, torch.tensor(sampled)[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(stepwise), teacher, atol=1e-5, rtol=0)
    # the positions matter: the plain 1-D positions a text model gets score the same tokens differently
    with torch.no_grad():
        plain = model(input_ids=full, pixel_values=pixels, image_grid_thw=grid,
                      position_ids=torch.arange(full.shape[1]).expand(3, 1, -1)).logits  # fmt: skip
    plain = plain[0, ids.shape[1] - 1 : -1].float().index_fill(-1, banned, -float("inf")).log_softmax(-1)
    assert float((plain.gather(-1, torch.tensor(sampled)[:, None]).squeeze(-1) - teacher).abs().max()) > 1e-4


def test_the_tiny_vlm_saves_and_loads_offline(tok, tmp_path):
    from transformers import AutoModelForImageTextToText

    model, processor = tiny_vl_model(tok), tiny_vl_processor(tok)
    model.save_pretrained(tmp_path), processor.save_pretrained(tmp_path)
    again, loaded = AutoModelForImageTextToText.from_pretrained(tmp_path), ImageOnlyQwen2VLProcessor.from_pretrained(tmp_path)
    enc = _encode(loaded, IMAGES[1])
    with torch.no_grad():
        assert torch.equal(model(**enc).logits, again(**enc).logits)
    assert sum(p.numel() for p in model.parameters()) < 300_000


def test_vision_facts_of_models(tok):
    model = tiny_vl_model(tok)
    assert is_vision_model(model) and is_vision_model(model.config)
    assert vision_token_ids(model) == [tok.convert_tokens_to_ids(t) for t in
                                       ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")]
    text = tiny_model(tiny_tokenizer())
    assert not is_vision_model(text) and vision_token_ids(text) == []
    with pytest.raises(ValueError, match="needs a tokenizer with the vision tokens"):
        tiny_vl_model(tiny_tokenizer())
    with pytest.raises(ValueError, match="family must be one of"):
        tiny_vl_model(tok, family="llava")


def _components(image, color) -> list[tuple[int, int]]:
    """(pixels, bounding-box area) of each 4-connected region of ``color`` in ``image``."""
    w, h = image.size
    px = image.load()
    seen, found = set(), []
    for x0 in range(w):
        for y0 in range(h):
            if (x0, y0) in seen or px[x0, y0] != color:
                continue
            stack, region = [(x0, y0)], []
            seen.add((x0, y0))
            while stack:
                x, y = stack.pop()
                region.append((x, y))
                for nx, ny in ((x + 1, y), (x - 1, y), (x, y + 1), (x, y - 1)):
                    if 0 <= nx < w and 0 <= ny < h and (nx, ny) not in seen and px[nx, ny] == color:
                        seen.add((nx, ny))
                        stack.append((nx, ny))
            xs, ys = [p[0] for p in region], [p[1] for p in region]
            found.append((len(region), (max(xs) - min(xs) + 1) * (max(ys) - min(ys) + 1)))
    return found


def test_the_shape_count_answer_is_the_red_squares_drawn():
    from tokengym.llm_envs.tasks.visual import RED, digit_reading_prompts, shape_count_prompts

    items = shape_count_prompts(12, seed=3)
    assert shape_count_prompts(12, seed=3)[5]["images"][0].tobytes() == items[5]["images"][0].tobytes()
    answers = set()
    for item in items:
        regions = _components(item["images"][0], RED)
        squares = sum(pixels == area for pixels, area in regions)  # a filled box; a circle fills less of its box
        assert str(squares) == item["answer"]
        answers.add(item["answer"])
    assert len(answers) >= 3
    assert len({item["answer"] for item in digit_reading_prompts(12, seed=3)}) >= 6
    with pytest.raises(ValueError, match="need 12 cells"):
        shape_count_prompts(1, size=36, max_count=9, distractors=3)
