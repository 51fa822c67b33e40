"""Prompts with images (issue 52): rendered through a vision-language processor once per prompt, recorded once per
group in the prompt table (and its checkpoints), refused with a clear error where they cannot be used."""

import pytest
import torch

from tokengym.llm_envs import PromptSource, PromptTable, TokenEnv
from tokengym.llm_envs.errors import PromptError
from tokengym.llm_envs.image_inputs import ImageInputs, encode_with_images
from tokengym.llm_envs.tasks.visual import digit_reading_prompts, shape_count_prompts
from tokengym.testing import tiny_vl_processor, tiny_vl_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_vl_tokenizer()


@pytest.fixture(scope="module")
def processor(tok):
    return tiny_vl_processor(tok)


def test_a_prompt_with_images_carries_its_processed_images_and_expanded_ids(tok, processor):
    items = shape_count_prompts(2, seed=0)
    prompt = PromptSource(items, tok, processor=processor).next()
    grid = prompt.images.image_grid_thw
    assert grid.tolist() == [[1, 12, 12]]  # a 48 x 48 image in 4-pixel patches
    assert int((prompt.ids == processor.image_token_id).sum()) == 36  # merged 2 x 2
    assert prompt.metadata == {"answer": items[0]["answer"]}  # the images are not metadata
    expected, _ = encode_with_images(processor, prompt.text, items[0]["images"])
    assert torch.equal(prompt.ids, expected)


def test_the_fingerprint_of_image_prompts_is_their_pixels(tok, processor):
    """The same images (new objects) give the same fingerprint; one changed pixel another."""
    first = PromptSource(shape_count_prompts(3, seed=0), tok, processor=processor).fingerprint()
    again = PromptSource(shape_count_prompts(3, seed=0), tok, processor=processor).fingerprint()
    changed = shape_count_prompts(3, seed=0)
    changed[2]["images"][0].putpixel((0, 0), (1, 2, 3))
    assert first == again
    assert PromptSource(changed, tok, processor=processor).fingerprint()["digest"] != first["digest"]


def test_images_without_a_processor_name_the_fix(tok):
    env = TokenEnv(shape_count_prompts(1), tok, batch_size=1, max_new_tokens=2, max_length=256)
    with pytest.raises((ValueError, PromptError), match="processor="):
        env.reset()


def test_a_placeholder_count_other_than_the_images_names_the_fix(tok, processor):
    item = shape_count_prompts(1)[0]
    item["images"] = item["images"] + digit_reading_prompts(1)[0]["images"]  # 2 images, 1 placeholder
    with pytest.raises((ValueError, PromptError), match="1 image placeholder"):
        PromptSource([item], tok, processor=processor).next()


def test_the_prompt_table_keeps_images_per_group_through_subset_merge_and_checkpoints(tok, processor):
    source = PromptSource(shape_count_prompts(2) + [{"prompt": "plain text"}], tok, processor=processor, epochs=1)
    table = PromptTable(pad_token_id=tok.pad_token_id)
    for prompt in source:
        table.add(prompt.group_id, prompt.ids, text=prompt.text, images=prompt.images)
    assert table.has_images and table.images(2) is None
    digests = {g: table.images(g).digest for g in (0, 1)}
    saved = torch.load(_save(table.state_dict()), weights_only=True)
    loaded = PromptTable.from_state_dict(saved)
    assert {g: loaded.images(g).digest for g in (0, 1)} == digests and loaded.images(2) is None
    assert table.subset([1]).images(1).digest == digests[1]
    merged = PromptTable().merge(table.subset([0])).merge(table.subset([2]))
    assert merged.images(0).digest == digests[0] and not merged.subset([2]).has_images
    with pytest.raises(TypeError, match="ImageInputs"):
        table.add(9, torch.tensor([5]), images=torch.zeros(2, 3))


def test_image_inputs_concatenate_in_order_and_check_their_grids():
    a = ImageInputs.of(torch.ones(4, 6), torch.tensor([[1, 2, 2]]))
    b = ImageInputs.of(torch.zeros(8, 6), torch.tensor([[1, 2, 4]]))
    both = ImageInputs.cat([a, None, b])
    assert both.image_grid_thw.tolist() == [[1, 2, 2], [1, 2, 4]] and both.pixel_values[:4].eq(1).all()
    assert ImageInputs.cat([None, None]) is None and a.digest != b.digest
    with pytest.raises(ValueError, match="covers 4 patches"):
        ImageInputs.of(torch.ones(5, 6), torch.tensor([[1, 2, 2]]))


def _save(state):
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer
