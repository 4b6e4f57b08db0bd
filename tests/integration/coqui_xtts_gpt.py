"""A tiny XTTS GPT recipe for the coqui ``trainer``: XTTS's GPT (coqui TTS, ``TTS/tts/layers/xtts/gpt.py``)
at toy size, trained the way ``recipes/ljspeech/xtts_v2/train_gpt_xtts.py`` trains it.

What is kept from XTTS:

* a transformers ``GPT2Model`` over ``[conditioning prompt; text tokens; audio code tokens]`` whose own token
  and position embeddings are replaced: separate text and audio embeddings (``nn.Embedding``'s own init, as
  XTTS), learned position embeddings for each, a conditioning encoder making the prompt from a "mel";
* a final LayerNorm and two heads (text, audio codes); the inputs framed with start/stop tokens, padding
  masked in attention and ignored in the loss (``ignore_index=-1``);
* the loss ``loss_text_ce * 0.01 + loss_mel_ce * 1.0`` (``gpt_loss_text_ce_weight``,
  ``gpt_loss_mel_ce_weight``), so the text head's gradients are 100x smaller than the audio head's;
* AdamW with betas (0.9, 0.96) and weight decay 1e-2 on the weights only (``optimizer_wd_only_on_weights``),
  MultiStepLR stepped per optimizer step.

What is not: the sizes (2 layers of width 64, vocabularies of 32 and 66), dropout (0 here, so that two runs
differ by their precision only), the DVAE and the perceiver conditioning (the codes and the "mel" are
synthetic), the learning rate (3e-3: the recipe's 5e-6 fine-tunes a trained model; this one starts from
scratch and has a few hundred steps).

The data is learnable: each text token of a sample is spoken as two audio codes, a fixed function of the token
and of the speaker, and the speaker is visible only in the conditioning "mel". This module does not import
ampguard.
"""

# No "from __future__ import annotations": coqpit reads the config's field types at run time.
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from coqui_tiny import build_trainer
from torch import nn
from torch.utils.data import DataLoader
from trainer import Trainer, TrainerConfig, TrainerModel
from transformers import GPT2Config, GPT2Model

TEXT_STOP, TEXT_START, TEXT_TOKENS = 0, 1, 32  # text ids 2..31 are symbols
AUDIO_CODES = 64
AUDIO_START, AUDIO_STOP, AUDIO_TOKENS = AUDIO_CODES, AUDIO_CODES + 1, AUDIO_CODES + 2
CODES_PER_TOKEN = 2
MAX_TEXT = 12
MIN_TEXT = 6
SPEAKERS = 4
COND_CHANNELS, COND_FRAMES = 8, 6  # the conditioning "mel": channels x frames, one prompt position per frame
TEXT_LOSS_WEIGHT, MEL_LOSS_WEIGHT = 0.01, 1.0  # GPTArgs.gpt_loss_text_ce_weight / gpt_loss_mel_ce_weight
EVAL_SAMPLES = 64
LR = 3e-3
ADAMW = {"betas": (0.9, 0.96), "eps": 1e-8, "weight_decay": 1e-2}  # GPTTrainerConfig.optimizer_params


@dataclass
class XttsGptConfig(TrainerConfig):
    """The recipe's training settings (GPTTrainerConfig), at toy size; ``epochs`` sets the length."""

    epochs: int = 1
    batch_size: int = 8
    train_samples: int = 2560  # 320 optimizer steps an epoch, every sample new
    data_seed: int = 0  # which samples (the held-out ones are seed 1)
    lr: float = LR  # what the Trainer logs; the model makes the optimizer (get_optimizer)
    lr_scheduler: str = "MultiStepLR"
    lr_scheduler_params: dict = field(default_factory=lambda: {"milestones": [200, 400], "gamma": 0.5})
    scheduler_after_epoch: bool = False
    use_grad_scaler: bool = True  # on CPU the coqui trainer keeps a scaler only through this flag
    run_eval: bool = False
    save_checkpoints: bool = False
    save_step: int = 1_000_000
    print_step: int = 1_000_000
    dashboard_logger: str = "tensorboard"
    training_seed: int = 1234


class LearnedPositions(nn.Module):
    """XTTS's LearnedPositionEmbeddings: a position table read from 0 (init N(0, 0.02), GPT-2's)."""

    def __init__(self, length: int, width: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(length, width)
        self.emb.weight.data.normal_(mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.emb(torch.arange(tokens.shape[1], device=tokens.device))


class NoPositions(nn.Module):
    """Replaces GPT2Model's own position embeddings (XTTS's ``null_position_embeddings``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*position_ids.shape, self.width, device=position_ids.device)


class TinyXttsGpt(TrainerModel):
    """XTTS's GPT at toy size, with ``train_step`` returning GPTTrainer's three losses."""

    def __init__(self, *, lr: float = LR, layers: int = 2, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.lr = lr
        text_length, audio_length = MAX_TEXT + 2, MAX_TEXT * CODES_PER_TOKEN + 2  # with start and stop
        self.conditioning_encoder = nn.Conv1d(COND_CHANNELS, width, kernel_size=1)
        self.text_embedding = nn.Embedding(TEXT_TOKENS, width)
        self.mel_embedding = nn.Embedding(AUDIO_TOKENS, width)
        self.text_pos_embedding = LearnedPositions(text_length, width)
        self.mel_pos_embedding = LearnedPositions(audio_length, width)
        config = GPT2Config(
            vocab_size=TEXT_TOKENS,  # unused: the token embeddings are replaced
            bos_token_id=TEXT_START,
            eos_token_id=TEXT_STOP,
            n_positions=COND_FRAMES + text_length + audio_length,
            n_embd=width,
            n_layer=layers,
            n_head=heads,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
        )
        self.gpt = GPT2Model(config)
        del self.gpt.wte
        self.gpt.wpe = NoPositions(width)
        self.final_norm = nn.LayerNorm(width)
        self.text_head = nn.Linear(width, TEXT_TOKENS)
        self.mel_head = nn.Linear(width, AUDIO_TOKENS)
        self.recorded_losses: list[torch.Tensor] = []  # the total loss of every train step, detached

    def forward(  # type: ignore[override]
        self,
        text: torch.Tensor,
        text_lengths: torch.Tensor,
        codes: torch.Tensor,
        code_lengths: torch.Tensor,
        cond: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``loss_text_ce, loss_mel_ce`` as XTTS's ``GPT.forward`` computes them."""
        text_inputs, text_targets = _framed(text, text_lengths, TEXT_START, TEXT_STOP)
        code_inputs, code_targets = _framed(codes, code_lengths, AUDIO_START, AUDIO_STOP)
        prompt = self.conditioning_encoder(cond).transpose(1, 2)
        text_emb = self.text_embedding(text_inputs) + self.text_pos_embedding(text_inputs)
        mel_emb = self.mel_embedding(code_inputs) + self.mel_pos_embedding(code_inputs)
        mask = torch.cat(
            [
                torch.ones(prompt.shape[:2], dtype=torch.bool),
                _within(text_lengths + 1, text_inputs.shape[1]),
                _within(code_lengths + 1, code_inputs.shape[1]),
            ],
            dim=1,
        )
        hidden = self.gpt(inputs_embeds=torch.cat([prompt, text_emb, mel_emb], dim=1), attention_mask=mask)
        enc = self.final_norm(hidden.last_hidden_state[:, prompt.shape[1] :])
        text_logits = self.text_head(enc[:, : text_inputs.shape[1]]).permute(0, 2, 1)
        mel_logits = self.mel_head(enc[:, -code_inputs.shape[1] :]).permute(0, 2, 1)
        return (
            F.cross_entropy(text_logits, text_targets, ignore_index=-1),
            F.cross_entropy(mel_logits, code_targets, ignore_index=-1),
        )

    def train_step(self, batch: dict[str, Any], criterion: Any, optimizer_idx: int | None = None):  # type: ignore[override]
        loss_text, loss_mel = self(**batch)
        loss = loss_text * TEXT_LOSS_WEIGHT + loss_mel * MEL_LOSS_WEIGHT
        self.recorded_losses.append(loss.detach().float())
        return {"model_outputs": loss_mel.detach()}, {
            "loss_text_ce": loss_text * TEXT_LOSS_WEIGHT,
            "loss_mel_ce": loss_mel * MEL_LOSS_WEIGHT,
            "loss": loss,
        }

    def get_criterion(self) -> None:  # type: ignore[override]
        return None

    def get_optimizer(self) -> torch.optim.Optimizer:
        """AdamW with weight decay on the weights only (GPTTrainer, ``optimizer_wd_only_on_weights``)."""
        not_weights = (nn.LayerNorm, nn.Embedding)
        decayed, other = [], []
        for module in self.modules():
            for name, param in module.named_parameters(recurse=False):
                (other if isinstance(module, not_weights) or name == "bias" else decayed).append(param)
        groups = [{"params": decayed}, {"params": other, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=self.lr, **ADAMW)

    def get_data_loader(
        self, config: TrainerConfig, *, is_eval: bool = False, samples: Any = None, verbose: bool = True
    ):  # type: ignore[override]
        generator = torch.Generator().manual_seed(config.training_seed)
        return DataLoader(
            make_samples(config.train_samples, seed=config.data_seed),
            batch_size=config.batch_size,
            shuffle=True,
            generator=generator,
        )

    @torch.no_grad()
    def eval_loss(self) -> float:
        """The recipe's loss on held-out samples, in float32 (no autocast), whatever the training precision."""
        was_training = self.training
        self.eval()
        try:
            batch = next(iter(DataLoader(make_samples(EVAL_SAMPLES, seed=1), batch_size=EVAL_SAMPLES)))
            with torch.autocast("cpu", enabled=False):
                loss_text, loss_mel = self(**batch)
            return float(loss_text * TEXT_LOSS_WEIGHT + loss_mel * MEL_LOSS_WEIGHT)
        finally:
            self.train(was_training)

    def train_losses(self) -> list[float]:
        return torch.stack(self.recorded_losses).tolist() if self.recorded_losses else []


def _within(lengths: torch.Tensor, width: int) -> torch.Tensor:
    return torch.arange(width)[None, :] < lengths[:, None]


def _framed(tokens: torch.Tensor, lengths: torch.Tensor, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """XTTS's framing: ``[start, x..., stop, (stop padding)]`` in, ``[x..., stop, stop, (-1)]`` as targets."""
    tokens = tokens.masked_fill(~_within(lengths, tokens.shape[1]), stop)
    padded = F.pad(tokens, (0, 1), value=stop)
    inputs = F.pad(padded, (1, 0), value=start)
    targets = F.pad(padded, (0, 1), value=stop).masked_fill(~_within(lengths + 2, padded.shape[1] + 1), -1)
    return inputs, targets


def speak(token: int, speaker: int) -> list[int]:
    """The audio codes of one text token said by ``speaker``: a fixed, learnable function of both."""
    return [(7 * token + 13 * speaker + 3 * i) % AUDIO_CODES for i in range(CODES_PER_TOKEN)]


def make_samples(count: int, *, seed: int) -> list[dict[str, torch.Tensor]]:
    """``count`` padded samples: text, its length, the codes, their length, the conditioning "mel"."""
    generator = torch.Generator().manual_seed(seed)
    voices = torch.randn(SPEAKERS, COND_CHANNELS, COND_FRAMES, generator=torch.Generator().manual_seed(99))
    samples = []
    for _ in range(count):
        length = int(torch.randint(MIN_TEXT, MAX_TEXT + 1, (), generator=generator))
        speaker = int(torch.randint(SPEAKERS, (), generator=generator))
        text = torch.full((MAX_TEXT,), TEXT_STOP)
        text[:length] = torch.randint(2, TEXT_TOKENS, (length,), generator=generator)
        codes = torch.full((MAX_TEXT * CODES_PER_TOKEN,), AUDIO_STOP)
        spoken = [code for token in text[:length].tolist() for code in speak(token, speaker)]
        codes[: len(spoken)] = torch.tensor(spoken)
        cond = voices[speaker] + 0.1 * torch.randn(COND_CHANNELS, COND_FRAMES, generator=generator)
        samples.append(
            {
                "text": text,
                "text_lengths": torch.tensor(length),
                "codes": codes,
                "code_lengths": torch.tensor(len(spoken)),
                "cond": cond,
            }
        )
    return samples


def float16_autocast_args(self: Trainer, **_: Any) -> tuple[str, torch.dtype]:
    """For ``Trainer._get_autocast_args``: what its CUDA path returns for ``precision="fp16"``, on the CPU (on
    the CPU the Trainer itself autocasts to bfloat16)."""
    return "cpu", torch.float16


def build_xtts_trainer(
    output_path: Path | str, *, mixed_precision: bool, seed: int = 0, lr: float = LR, **config: Any
) -> Trainer:
    """The recipe in a coqui Trainer on CPU: float32 (``mixed_precision=False``, no scaler), or autocast with
    the Trainer's own ``GradScaler()`` made a CPU scaler; the caller makes the autocast float16 by setting
    ``Trainer._get_autocast_args`` to :func:`float16_autocast_args`."""
    return build_trainer(
        output_path,
        seed=seed,
        model_factory=lambda: TinyXttsGpt(lr=lr),
        config_class=XttsGptConfig,
        lr=lr,
        mixed_precision=mixed_precision,
        use_grad_scaler=mixed_precision,
        precision="bf16",  # on CPU the Trainer keeps a scaler for mixed precision only when this is not "fp16"
        **config,
    )
