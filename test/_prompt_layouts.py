"""Token kinds of the prompt the engine serves (no test here): the full-size 8-camera preset's
prompt as `preprocess.prompt.build_prompt_ids` builds it (BOS, per camera its "Image k" label
and 198 image tokens, the chat turn), right-padded to a bucket, as
`runtime.flash_attention.token_kinds` classifies it."""
import torch

from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.preprocess.prompt import build_prompt_ids
from molmobot_policy.preprocess.tokenizer import resolve_tokenizer
from molmobot_policy.runtime import flash_attention as fa

EIGHT_CAMERAS = MolmoBotConfig.from_name('molmobot-4b-8cam')


def served_kinds(bucket: int, instruction: str = 'pick up the red cube and put it in the bowl',
                 cfg: MolmoBotConfig = EIGHT_CAMERAS) -> torch.Tensor:
    """int32 (1, bucket) on the CPU: the kinds of `cfg`'s prompt for `instruction` (the
    built-in tokenizer), padded to `bucket`. ValueError if the prompt is longer."""
    tokens = cfg.tokens
    ids = build_prompt_ids(resolve_tokenizer('auto', tokens), tokens, cfg.max_images,
                           cfg.tokens_per_image, instruction)
    if len(ids) > bucket:
        raise ValueError(f'the prompt has {len(ids)} tokens, more than the bucket {bucket}')
    input_ids = torch.full((1, bucket), tokens.bos, dtype=torch.int64)
    input_ids[0, :len(ids)] = torch.as_tensor(ids)
    attention_mask = torch.arange(bucket)[None] < len(ids)
    image_ids = torch.tensor(tokens.image_special_ids, dtype=torch.int64)
    return fa.token_kinds(input_ids, attention_mask, image_ids)
