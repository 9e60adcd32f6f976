"""The architecture zoo: real model code nobody here wrote, from small configs
(random weights, no download, dropout on, in train mode), each with a batch
for one rank and the loss the model computes itself.

Each entry is run by tests/test_zoo.py on 2 gloo ranks: the transpiled step
against torch DDP running the same step in the same processes. Which modes and
backends an architecture runs in is a deterministic function of its place in
the catalogue (`runs_of`). torchvision and timm do not install beside torch
2.13 here; their architectures come from transformers' implementations of the
same networks (ResNet, ConvNeXt, EfficientNet, MobileNet, RegNet, ...) and
from torch's own layers.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Callable

import torch
import torch.nn as nn

try:
    import transformers as T
except ImportError:  # the zoo is skipped without the test extra
    T = None


class Kind(enum.Enum):
    DECODER = "decoder"
    ENCODER = "encoder"
    ENCODER_DECODER = "encoder-decoder"
    VISION = "vision"
    AUDIO = "audio"
    MOE = "mixture of experts"
    STATE_SPACE = "state space"
    MULTIMODAL = "multimodal"


@dataclasses.dataclass(frozen=True)
class Arch:
    """One architecture.

    build: the model, in train mode (the caller seeds torch first).
    batch: one rank's batch from a generator, as keyword arguments of the
        model's forward; the model computes its loss (`model(**batch).loss`).
    refused: where a static program cannot train it yet, a regex the
        TranspileError of its first call matches (the reason is in `why`).
    loss: for a model without a loss of its own, the loss from the model and
        the batch.
    find_unused: DDP needs find_unused_parameters=True (a parameter without a
        gradient on some rank: an expert no token is routed to); the
        transpiled step is given it too, where its mode takes it.
    """
    name: str
    kind: Kind
    source: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], dict]
    features: tuple[str, ...] = ()
    refused: str | None = None
    why: str = ""
    find_unused: bool = False
    loss: Callable[[nn.Module, dict], torch.Tensor] | None = None

    def loss_of(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """The model's own loss, or `loss` for a model that computes none."""
        return model(**batch).loss if self.loss is None else self.loss(model, batch)


def step_of(arch: Arch):
    """The training step of every run: the optimizer's step on the model's loss."""
    def step(model, opt, batch):
        opt.zero_grad()
        loss = arch.loss_of(model, batch)
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def quiet():
    """transformers logs a warning per model built from a config."""
    logging.getLogger("transformers").setLevel(logging.ERROR)


# ---- batches -------------------------------------------------------------------

VOCAB = 64


def tokens_lm(seq: int = 8):
    """Causal or masked LM: tokens and the same tokens as labels."""
    def batch(g):
        x = torch.randint(2, VOCAB, (2, seq), generator=g)
        return dict(input_ids=x, labels=x)
    return batch


def tokens_masked_lm(seq: int = 8):
    """Tokens, an attention mask with padding on the second row, labels."""
    def batch(g):
        x = torch.randint(2, VOCAB, (2, seq), generator=g)
        mask = torch.ones(2, seq, dtype=torch.long)
        mask[1, seq - 2:] = 0
        return dict(input_ids=x, attention_mask=mask, labels=x)
    return batch


def tokens_seq2seq(src: int = 8, tgt: int = 5):
    def batch(g):
        return dict(input_ids=torch.randint(2, VOCAB, (2, src), generator=g),
                    labels=torch.randint(2, VOCAB, (2, tgt), generator=g))
    return batch


def tokens_classes(seq: int = 8, classes: int = 3):
    def batch(g):
        return dict(input_ids=torch.randint(2, VOCAB, (2, seq), generator=g),
                    labels=torch.randint(0, classes, (2,), generator=g))
    return batch


def images_classes(size: int = 32, channels: int = 3, classes: int = 3):
    def batch(g):
        return dict(pixel_values=torch.randn(2, channels, size, size, generator=g),
                    labels=torch.randint(0, classes, (2,), generator=g))
    return batch


def tokens_masked_classes(seq: int = 8, classes: int = 3):
    """Tokens, an attention mask with padding on the second row, a class a row."""
    def batch(g):
        x = torch.randint(2, VOCAB, (2, seq), generator=g)
        mask = torch.ones(2, seq, dtype=torch.long)
        mask[1, seq - 2:] = 0
        return dict(input_ids=x, attention_mask=mask,
                    labels=torch.randint(0, classes, (2,), generator=g))
    return batch


def tokens_seq2seq_masked(src: int = 8, tgt: int = 5):
    """Source tokens with padding on the second row (attention mask), target tokens."""
    def batch(g):
        mask = torch.ones(2, src, dtype=torch.long)
        mask[1, src - 3:] = 0
        return dict(input_ids=torch.randint(2, VOCAB, (2, src), generator=g),
                    attention_mask=mask,
                    labels=torch.randint(2, VOCAB, (2, tgt), generator=g))
    return batch


def audio_seq2seq(features: int = 8, frames: int = 16, tgt: int = 6, channels_first: bool = True):
    """Spectrogram features, (batch, features, frames) as Whisper takes them or
    (batch, frames, features) as Speech2Text does, and target tokens."""
    def batch(g):
        shape = (2, features, frames) if channels_first else (2, frames, features)
        return dict(input_features=torch.randn(*shape, generator=g),
                    labels=torch.randint(3, VOCAB, (2, tgt), generator=g))
    return batch


def waveform_ctc(samples: int = 400, vocab: int = 16, tgt: int = 5):
    """Raw audio and a transcript of `tgt` characters (no blank: 0)."""
    def batch(g):
        return dict(input_values=torch.randn(2, samples, generator=g),
                    labels=torch.randint(1, vocab, (2, tgt), generator=g))
    return batch


def waveform_classes(samples: int = 400, classes: int = 3):
    def batch(g):
        return dict(input_values=torch.randn(2, samples, generator=g),
                    labels=torch.randint(0, classes, (2,), generator=g))
    return batch


def spectrogram_classes(frames: int = 16, bins: int = 16, classes: int = 3):
    """A spectrogram, (batch, frames, mel bins), and a class a row."""
    def batch(g):
        return dict(input_values=torch.randn(2, frames, bins, generator=g),
                    labels=torch.randint(0, classes, (2,), generator=g))
    return batch


def tokens_images(seq: int = 8, size: int = 16):
    """Captions (padding on the second row) and their images; the model's
    contrastive loss (return_loss=True)."""
    def batch(g):
        mask = torch.ones(2, seq, dtype=torch.long)
        mask[1, seq - 2:] = 0
        return dict(input_ids=torch.randint(2, VOCAB, (2, seq), generator=g),
                    attention_mask=mask,
                    pixel_values=torch.randn(2, 3, size, size, generator=g),
                    return_loss=True)
    return batch


def images_captions(seq: int = 8, size: int = 16):
    """Images and their captions, the captions as labels (captioning LM loss)."""
    def batch(g):
        x = torch.randint(2, VOCAB, (2, seq), generator=g)
        return dict(pixel_values=torch.randn(2, 3, size, size, generator=g),
                    input_ids=x, labels=x)
    return batch


def images_noise(size: int = 8, channels: int = 3, steps: int = 1000):
    """A denoising batch: noisy images, their timesteps, the noise to predict."""
    def batch(g):
        return dict(sample=torch.randn(2, channels, size, size, generator=g),
                    timestep=torch.randint(0, steps, (2,), generator=g),
                    noise=torch.randn(2, channels, size, size, generator=g))
    return batch


def series_forecast(context: int = 12, prediction: int = 4, lags: int = 2, features: int = 2):
    """A time series forecast: past values (the context plus the largest lag),
    time features, the observed mask and the values to predict; the model's
    loss is its distribution's negative log-likelihood of them."""
    def batch(g):
        past = context + lags
        return dict(past_values=torch.randn(2, past, generator=g),
                    past_time_features=torch.randn(2, past, features, generator=g),
                    past_observed_mask=torch.ones(2, past),
                    future_values=torch.randn(2, prediction, generator=g),
                    future_time_features=torch.randn(2, prediction, features, generator=g))
    return batch


def series_channels(context: int = 16, channels: int = 2):
    """Multichannel series for masked pretraining (the model masks patches itself)."""
    def batch(g):
        return dict(past_values=torch.randn(2, context, channels, generator=g))
    return batch


def video_classes(frames: int = 4, size: int = 16, classes: int = 3):
    """Clips of frames and a class a clip."""
    def batch(g):
        return dict(pixel_values=torch.randn(2, frames, 3, size, size, generator=g),
                    labels=torch.randint(0, classes, (2,), generator=g))
    return batch


def images_segments(size: int = 32, classes: int = 3):
    """Images and a class per pixel (semantic segmentation)."""
    def batch(g):
        return dict(pixel_values=torch.randn(2, 3, size, size, generator=g),
                    labels=torch.randint(0, classes, (2, size, size), generator=g))
    return batch


def hf(model_cls, config_cls, **config):
    """transformers' model from a config (train mode: dropout on)."""
    def build():
        quiet()
        return model_cls(config_cls(**config)).train()
    return build


# ---- torch's own layers, and diffusers ------------------------------------------
# Models without a loss of their own (Arch.loss). torchvision does not install
# here: its ResNet-18 and MobileNetV3-Small as torchvision defines them
# (torchvision/models/resnet.py, mobilenetv3.py), at a fraction of the width.

class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision.models.resnet18(num_classes=...) at width/8 (64 -> 8 channels)."""

    def __init__(self, layers=(2, 2, 2, 2), width=8, num_classes=3):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(width, layers[0])
        self.layer2 = self._make_layer(width * 2, layers[1], 2)
        self.layer3 = self._make_layer(width * 4, layers[2], 2)
        self.layer4 = self._make_layer(width * 8, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride, bias=False),
                                       nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [BasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _make_divisible(v, divisor=8):
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


def conv_bn_act(cin, cout, kernel, stride=1, groups=1, act=nn.Hardswish):
    """torchvision.ops.Conv2dNormActivation with MobileNetV3's BatchNorm."""
    layers = [nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
              nn.BatchNorm2d(cout, eps=0.001, momentum=0.01)]
    return nn.Sequential(*layers, *([act(inplace=True)] if act else []))


class SqueezeExcitation(nn.Module):
    def __init__(self, channels, squeeze):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1, self.fc2 = nn.Conv2d(channels, squeeze, 1), nn.Conv2d(squeeze, channels, 1)
        self.activation, self.scale_activation = nn.ReLU(), nn.Hardsigmoid()

    def forward(self, x):
        s = self.fc2(self.activation(self.fc1(self.avgpool(x))))
        return self.scale_activation(s) * x


class InvertedResidual(nn.Module):
    def __init__(self, cin, kernel, expanded, cout, use_se, use_hs, stride):
        super().__init__()
        act = nn.Hardswish if use_hs else nn.ReLU
        self.use_res_connect = stride == 1 and cin == cout
        layers = [conv_bn_act(cin, expanded, 1, act=act)] if expanded != cin else []
        layers.append(conv_bn_act(expanded, expanded, kernel, stride, expanded, act))
        if use_se:
            layers.append(SqueezeExcitation(expanded, _make_divisible(expanded // 4)))
        layers.append(conv_bn_act(expanded, cout, 1, act=None))
        self.block = nn.Sequential(*layers)

    def forward(self, x):
        out = self.block(x)
        return out + x if self.use_res_connect else out


class MobileNetV3Small(nn.Module):
    """torchvision.models.mobilenet_v3_small(width_mult=0.25, num_classes=...)."""
    SETTING = [(16, 3, 16, 16, True, False, 2), (16, 3, 72, 24, False, False, 2),
               (24, 3, 88, 24, False, False, 1), (24, 5, 96, 40, True, True, 2),
               (40, 5, 240, 40, True, True, 1), (40, 5, 240, 40, True, True, 1),
               (40, 5, 120, 48, True, True, 1), (48, 5, 144, 48, True, True, 1),
               (48, 5, 288, 96, True, True, 2), (96, 5, 576, 96, True, True, 1),
               (96, 5, 576, 96, True, True, 1)]

    def __init__(self, width_mult=0.25, num_classes=3, dropout=0.2):
        super().__init__()
        ch = lambda c: _make_divisible(c * width_mult)  # noqa: E731
        setting = [(ch(i), k, ch(e), ch(o), se, hs, s) for i, k, e, o, se, hs, s in self.SETTING]
        layers = [conv_bn_act(3, setting[0][0], 3, 2)]
        layers += [InvertedResidual(*cnf) for cnf in setting]
        last_in = setting[-1][3]
        layers.append(conv_bn_act(last_in, 6 * last_in, 1))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        last_channel = ch(1024)
        self.classifier = nn.Sequential(
            nn.Linear(6 * last_in, last_channel), nn.Hardswish(inplace=True),
            nn.Dropout(p=dropout, inplace=True), nn.Linear(last_channel, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class TokenClassifier(nn.Module):
    """nn.TransformerEncoder (batch_first, pre-norm) over learned token and
    position embeddings, mean-pooled over the unpadded tokens, a linear head."""

    def __init__(self, d_model=16, heads=2, layers=2, positions=16, classes=3):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model, padding_idx=0)
        self.positions = nn.Parameter(torch.randn(positions, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, 2 * d_model, dropout=0.1,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(d_model),
                                             enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids) + self.positions[:input_ids.shape[1]]
        x = self.encoder(x, src_key_padding_mask=attention_mask == 0)
        keep = attention_mask.unsqueeze(-1).to(x.dtype)
        return self.head((x * keep).sum(1) / keep.sum(1))


class WordLanguageModel(nn.Module):
    """pytorch/examples word_language_model/model.py RNNModel("LSTM", tied=True):
    dropout on the embeddings, between the LSTM's layers and on its output, the
    decoder's weight tied to the embedding's, log-softmax over the vocabulary."""

    def __init__(self, ninp=16, nlayers=2, dropout=0.2):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(VOCAB, ninp)
        self.rnn = nn.LSTM(ninp, ninp, nlayers, dropout=dropout)
        self.decoder = nn.Linear(ninp, VOCAB)
        self.decoder.weight = self.encoder.weight

    def forward(self, input, hidden=None):
        output, hidden = self.rnn(self.drop(self.encoder(input)), hidden)
        decoded = self.decoder(self.drop(output)).view(-1, VOCAB)
        return nn.functional.log_softmax(decoded, dim=1), hidden


def sequence_lm_loss(model, batch):
    """The word language model's: the next token of a (sequence, batch) block."""
    tokens = batch["input_ids"].t().contiguous()
    return nn.functional.nll_loss(model(tokens[:-1])[0], tokens[1:].reshape(-1))


class LSTMClassifier(nn.Module):
    """The text classifier of countless tutorials: a bidirectional, batch-first
    2-layer LSTM with dropout over embeddings (a padding index), the last
    layer's final states of both directions concatenated, a linear head."""

    def __init__(self, dim=16, classes=3):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim, padding_idx=0)
        self.rnn = nn.LSTM(dim, dim, num_layers=2, batch_first=True, bidirectional=True,
                           dropout=0.1)
        self.head = nn.Linear(2 * dim, classes)

    def forward(self, input_ids):
        _, (h, _) = self.rnn(self.embed(input_ids))
        return self.head(torch.cat([h[-2], h[-1]], dim=1))


class Seq2SeqGRU(nn.Module):
    """The seq2seq translation tutorial's model (pytorch/tutorials
    intermediate_source/seq2seq_translation_tutorial.py: EncoderRNN,
    BahdanauAttention, AttnDecoderRNN), encoder and decoder in one module: a
    batch-first GRU encoder whose final state starts the decoder, which runs
    one GRU step per target token (teacher forcing) with additive attention
    over the encoder's outputs."""

    def __init__(self, hidden=16, steps=5):
        super().__init__()
        self.steps = steps
        self.enc_embedding = nn.Embedding(VOCAB, hidden)
        self.enc_gru = nn.GRU(hidden, hidden, batch_first=True)
        self.dropout = nn.Dropout(0.1)
        self.embedding = nn.Embedding(VOCAB, hidden)
        self.Wa, self.Ua, self.Va = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), \
            nn.Linear(hidden, 1)
        self.gru = nn.GRU(2 * hidden, hidden, batch_first=True)
        self.out = nn.Linear(hidden, VOCAB)

    def attention(self, query, keys):
        scores = self.Va(torch.tanh(self.Wa(query) + self.Ua(keys))).squeeze(2).unsqueeze(1)
        weights = nn.functional.softmax(scores, dim=-1)
        return torch.bmm(weights, keys), weights

    def forward_step(self, input, hidden, encoder_outputs):
        embedded = self.dropout(self.embedding(input))
        context, _ = self.attention(hidden.permute(1, 0, 2), encoder_outputs)
        output, hidden = self.gru(torch.cat((embedded, context), dim=2), hidden)
        return self.out(output), hidden

    def forward(self, input_ids, labels):
        encoder_outputs, hidden = self.enc_gru(self.dropout(self.enc_embedding(input_ids)))
        decoder_input = torch.empty(input_ids.size(0), 1, dtype=torch.long).fill_(1)   # SOS
        outputs = []
        for i in range(self.steps):
            output, hidden = self.forward_step(decoder_input, hidden, encoder_outputs)
            outputs.append(output)
            decoder_input = labels[:, i].unsqueeze(1)   # teacher forcing
        return nn.functional.log_softmax(torch.cat(outputs, dim=1), dim=-1)


def seq2seq_loss(model, batch):
    out = model(batch["input_ids"], batch["labels"])
    return nn.functional.nll_loss(out.view(-1, out.size(-1)), batch["labels"].view(-1))


def tokens_classes_loss(model, batch):
    return nn.functional.cross_entropy(model(batch["input_ids"]), batch["labels"])


def images_loss(model, batch):
    """Cross entropy of a classifier that returns logits."""
    return nn.functional.cross_entropy(model(batch["pixel_values"]), batch["labels"])


def tokens_loss(model, batch):
    return nn.functional.cross_entropy(model(batch["input_ids"], batch["attention_mask"]),
                                       batch["labels"])


def denoising_loss(model, batch):
    """DDPM's objective: the noise, predicted from the noisy sample and its timestep."""
    predicted = model(sample=batch["sample"], timestep=batch["timestep"]).sample
    return nn.functional.mse_loss(predicted, batch["noise"])


def unet_2d():
    from diffusers import UNet2DModel
    return UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                       block_out_channels=(8, 16), norm_num_groups=4, attention_head_dim=8,
                       down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D"), dropout=0.1).train()


# ---- the catalogue -------------------------------------------------------------

# token ids inside the vocabulary (batches draw their tokens from 2..VOCAB-1)
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=1)
SEQ2SEQ_IDS = dict(IDS, decoder_start_token_id=1)
DROP = dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
# a tiny wav2vec2-style feature encoder: 400 samples -> 48 frames
WAVE = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
            conv_dim=(8, 8), conv_stride=(4, 2), conv_kernel=(8, 4), num_feat_extract_layers=2,
            num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2)


def decoder(model_cls, config_cls, **config):
    """A tiny decoder-only LM: 16 wide, 1 layer, 2 heads (unless overridden)."""
    return hf(model_cls, config_cls, **{**dict(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=16), **IDS, **config})


def encoder(model_cls, config_cls, **config):
    """A tiny BERT-like encoder: 16 wide, 1 layer, 2 heads, dropout on."""
    return hf(model_cls, config_cls, **{**dict(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, num_labels=3), **DROP, **config})


def bart_like(model_cls, config_cls, **config):
    """A tiny BART-family encoder-decoder, dropout on everywhere."""
    return hf(model_cls, config_cls, **{**dict(
        vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_position_embeddings=16, dropout=0.1, attention_dropout=0.1,
        activation_dropout=0.1), **SEQ2SEQ_IDS, **config})


def vit_like(model_cls, config_cls, **config):
    """A tiny ViT-family classifier of 16x16 images in 4x4 patches."""
    return hf(model_cls, config_cls, **{**dict(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        image_size=16, patch_size=4, num_labels=3), **DROP, **config})


def unit_batchnorms(build):
    """`build`, its BatchNorm weights set to 1 (as torchvision and timm start
    them): transformers draws EfficientNet's and MobileViT's from N(0, 0.02),
    which shrinks the signal ~50x a block (logits of 1e-19)."""
    def built():
        model = build()
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.affine:
                nn.init.ones_(m.weight)
        return model
    return built


def torch_model(cls, **kwargs):
    def build():
        return cls(**kwargs).train()
    return build


def catalogue() -> list[Arch]:
    """Every architecture, in a fixed order (runs_of depends on it); empty
    without transformers."""
    if T is None:
        return []
    D, E, S, V = Kind.DECODER, Kind.ENCODER, Kind.ENCODER_DECODER, Kind.VISION
    return [
        Arch("gpt2", D, "transformers.GPT2LMHeadModel",
             hf(T.GPT2LMHeadModel, T.GPT2Config, vocab_size=VOCAB, n_embd=16, n_layer=1,
                n_head=2, n_positions=16),
             tokens_lm(), ("dropout", "tied embeddings", "layernorm", "learned positions")),

        # ---- decoders (causal LM heads)
        Arch("gpt_neo", D, "transformers.GPTNeoForCausalLM",
             decoder(T.GPTNeoForCausalLM, T.GPTNeoConfig, num_hidden_layers=2,
                     attention_types=[[["global", "local"], 1]], window_size=4,
                     resid_dropout=0.1, embed_dropout=0.1, attention_dropout=0.1),
             tokens_lm(), ("dropout", "tied embeddings", "layernorm", "learned positions",
                           "sliding window")),
        Arch("gptj", D, "transformers.GPTJForCausalLM",
             hf(T.GPTJForCausalLM, T.GPTJConfig, vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2,
                n_inner=32, n_positions=16, rotary_dim=4, resid_pdrop=0.1, embd_pdrop=0.1,
                attn_pdrop=0.1, **IDS),
             tokens_masked_lm(), ("dropout", "layernorm", "rotary", "parallel attention",
                                  "attention mask")),
        Arch("gpt_neox", D, "transformers.GPTNeoXForCausalLM",
             decoder(T.GPTNeoXForCausalLM, T.GPTNeoXConfig, hidden_dropout=0.1,
                     attention_dropout=0.1),
             tokens_lm(), ("dropout", "layernorm", "rotary", "parallel attention")),
        Arch("llama", D, "transformers.LlamaForCausalLM",
             decoder(T.LlamaForCausalLM, T.LlamaConfig, num_key_value_heads=1,
                     attention_dropout=0.1),
             tokens_masked_lm(), ("dropout", "rmsnorm", "rotary", "grouped-query attention",
                                  "attention mask")),
        Arch("mistral", D, "transformers.MistralForCausalLM",
             decoder(T.MistralForCausalLM, T.MistralConfig, num_key_value_heads=1,
                     sliding_window=4, attention_dropout=0.1),
             tokens_lm(), ("dropout", "rmsnorm", "rotary", "grouped-query attention",
                           "sliding window")),
        Arch("qwen2", D, "transformers.Qwen2ForCausalLM",
             decoder(T.Qwen2ForCausalLM, T.Qwen2Config, num_key_value_heads=1,
                     attention_dropout=0.1),
             tokens_masked_lm(), ("dropout", "rmsnorm", "rotary", "grouped-query attention",
                                  "attention mask", "qkv bias")),
        Arch("qwen3", D, "transformers.Qwen3ForCausalLM",
             decoder(T.Qwen3ForCausalLM, T.Qwen3Config, num_key_value_heads=1, head_dim=8,
                     attention_dropout=0.1),
             tokens_lm(), ("dropout", "rmsnorm", "rotary", "grouped-query attention",
                           "qk norm")),
        Arch("gemma", D, "transformers.GemmaForCausalLM",
             decoder(T.GemmaForCausalLM, T.GemmaConfig, num_key_value_heads=1, head_dim=8,
                     attention_dropout=0.1),
             tokens_lm(), ("dropout", "tied embeddings", "rmsnorm", "rotary",
                           "multi-query attention", "embedding scale")),
        Arch("gemma2", D, "transformers.Gemma2ForCausalLM",
             decoder(T.Gemma2ForCausalLM, T.Gemma2Config, num_hidden_layers=2,
                     num_key_value_heads=1, head_dim=8, sliding_window=4,
                     query_pre_attn_scalar=8, attention_dropout=0.1),
             tokens_masked_lm(), ("dropout", "tied embeddings", "rmsnorm", "rotary",
                                  "sliding window", "logit softcap", "attention mask")),
        Arch("phi", D, "transformers.PhiForCausalLM",
             decoder(T.PhiForCausalLM, T.PhiConfig, resid_pdrop=0.1, embd_pdrop=0.1,
                     attention_dropout=0.1),
             tokens_lm(), ("dropout", "layernorm", "rotary", "partial rotary",
                           "parallel attention")),
        Arch("phi3", D, "transformers.Phi3ForCausalLM",
             decoder(T.Phi3ForCausalLM, T.Phi3Config, resid_pdrop=0.1, embd_pdrop=0.1,
                     attention_dropout=0.1),
             tokens_masked_lm(), ("dropout", "rmsnorm", "rotary", "fused qkv",
                                  "attention mask")),
        Arch("opt", D, "transformers.OPTForCausalLM",
             decoder(T.OPTForCausalLM, T.OPTConfig, ffn_dim=32, word_embed_proj_dim=16,
                     dropout=0.1, attention_dropout=0.1),
             tokens_masked_lm(), ("dropout", "tied embeddings", "layernorm",
                                  "learned positions", "attention mask")),
        Arch("bloom", D, "transformers.BloomForCausalLM",
             hf(T.BloomForCausalLM, T.BloomConfig, vocab_size=VOCAB, hidden_size=16, n_layer=1,
                n_head=2, hidden_dropout=0.1, attention_dropout=0.1, **IDS),
             tokens_masked_lm(), ("dropout", "tied embeddings", "layernorm", "alibi",
                                  "attention mask")),
        Arch("falcon", D, "transformers.FalconForCausalLM",
             decoder(T.FalconForCausalLM, T.FalconConfig, hidden_dropout=0.1,
                     attention_dropout=0.1),
             tokens_lm(), ("dropout", "tied embeddings", "layernorm", "rotary",
                           "multi-query attention", "parallel attention")),
        Arch("codegen", D, "transformers.CodeGenForCausalLM",
             hf(T.CodeGenForCausalLM, T.CodeGenConfig, vocab_size=VOCAB, n_embd=16, n_layer=1,
                n_head=4, n_inner=32, n_positions=16, n_ctx=16, rotary_dim=2, resid_pdrop=0.1,
                embd_pdrop=0.1, attn_pdrop=0.1, **IDS),
             tokens_lm(), ("dropout", "layernorm", "rotary", "parallel attention")),
        Arch("stablelm", D, "transformers.StableLmForCausalLM",
             decoder(T.StableLmForCausalLM, T.StableLmConfig, num_key_value_heads=2,
                     hidden_dropout=0.1, attention_dropout=0.1, qk_layernorm=True),
             tokens_masked_lm(), ("dropout", "layernorm", "rotary", "partial rotary",
                                  "qk norm", "attention mask")),
        Arch("olmo", D, "transformers.OlmoForCausalLM",
             decoder(T.OlmoForCausalLM, T.OlmoConfig, attention_dropout=0.1, clip_qkv=8.0),
             tokens_lm(), ("dropout", "layernorm", "non-parametric layernorm", "rotary",
                           "qkv clipping")),
        Arch("olmo2", D, "transformers.Olmo2ForCausalLM",
             decoder(T.Olmo2ForCausalLM, T.Olmo2Config, attention_dropout=0.1),
             tokens_masked_lm(), ("dropout", "rmsnorm", "rotary", "qk norm", "post-norm",
                                  "attention mask")),
        Arch("starcoder2", D, "transformers.Starcoder2ForCausalLM",
             decoder(T.Starcoder2ForCausalLM, T.Starcoder2Config, num_key_value_heads=1,
                     sliding_window=4, residual_dropout=0.1, embedding_dropout=0.1,
                     attention_dropout=0.1),
             tokens_lm(), ("dropout", "tied embeddings", "layernorm", "rotary",
                           "grouped-query attention", "sliding window")),
        Arch("biogpt", D, "transformers.BioGptForCausalLM",
             decoder(T.BioGptForCausalLM, T.BioGptConfig, hidden_dropout_prob=0.1,
                     attention_probs_dropout_prob=0.1, activation_dropout=0.1),
             tokens_masked_lm(), ("dropout", "tied embeddings", "layernorm",
                                  "learned positions", "embedding scale", "attention mask")),
        Arch("xglm", D, "transformers.XGLMForCausalLM",
             hf(T.XGLMForCausalLM, T.XGLMConfig, vocab_size=VOCAB, d_model=16, ffn_dim=32,
                num_layers=1, attention_heads=2, max_position_embeddings=16, dropout=0.1,
                attention_dropout=0.1, activation_dropout=0.1, decoder_start_token_id=1, **IDS),
             tokens_lm(), ("dropout", "tied embeddings", "layernorm", "sinusoidal positions")),
        Arch("cohere", D, "transformers.CohereForCausalLM",
             decoder(T.CohereForCausalLM, T.CohereConfig, attention_dropout=0.1),
             tokens_masked_lm(), ("dropout", "tied embeddings", "layernorm", "rotary",
                                  "parallel attention", "logit scale", "attention mask")),
        Arch("granite", D, "transformers.GraniteForCausalLM",
             decoder(T.GraniteForCausalLM, T.GraniteConfig, num_key_value_heads=1,
                     attention_dropout=0.1, embedding_multiplier=12.0, residual_multiplier=0.22,
                     attention_multiplier=0.125, logits_scaling=4.0),
             tokens_lm(), ("dropout", "rmsnorm", "rotary", "grouped-query attention",
                           "scaling multipliers")),
        Arch("gpt_bigcode", D, "transformers.GPTBigCodeForCausalLM",
             hf(T.GPTBigCodeForCausalLM, T.GPTBigCodeConfig, vocab_size=VOCAB, n_embd=16,
                n_layer=1, n_head=2, n_inner=32, n_positions=16, multi_query=True, **IDS),
             tokens_masked_lm(), ("dropout", "tied embeddings", "layernorm", "learned positions",
                                  "multi-query attention", "attention mask")),
        Arch("mpt", D, "transformers.MptForCausalLM",
             hf(T.MptForCausalLM, T.MptConfig, vocab_size=VOCAB, d_model=16, n_heads=2,
                n_layers=1, expansion_ratio=2, max_seq_len=16, **IDS),
             # no dropout: its only knob, attn_config.attn_pdrop, is typed int (5.24 refuses 0.1)
             tokens_lm(), ("tied embeddings", "layernorm", "alibi")),

        # ---- encoders (masked LM and sequence classification heads)
        Arch("bert", E, "transformers.BertForMaskedLM",
             hf(T.BertForMaskedLM, T.BertConfig, vocab_size=VOCAB, hidden_size=16,
                num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                max_position_embeddings=16),
             tokens_lm(), ("dropout", "tied embeddings", "layernorm", "learned positions")),
        # decides on tensor values: `if is_global_attn:`, a padding check (capture/decisions.py)
        Arch("longformer", E, "transformers.LongformerForMaskedLM",
             hf(T.LongformerForMaskedLM, T.LongformerConfig, vocab_size=VOCAB, hidden_size=16,
                num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                attention_window=4, max_position_embeddings=40, pad_token_id=1),
             tokens_lm(), ("dropout", "tied embeddings", "layernorm", "sliding window",
                           "decisions on values"),
             find_unused=True),
        Arch("roberta", E, "transformers.RobertaForMaskedLM",
             encoder(T.RobertaForMaskedLM, T.RobertaConfig, max_position_embeddings=20,
                     pad_token_id=1, bos_token_id=0, eos_token_id=1),
             tokens_masked_lm(), ("dropout", "tied embeddings", "layernorm", "learned positions",
                                  "attention mask")),
        Arch("distilbert", E, "transformers.DistilBertForSequenceClassification",
             hf(T.DistilBertForSequenceClassification, T.DistilBertConfig, vocab_size=VOCAB,
                dim=16, n_layers=1, n_heads=2, hidden_dim=32, max_position_embeddings=16,
                dropout=0.1, attention_dropout=0.1, seq_classif_dropout=0.1, num_labels=3,
                pad_token_id=0),
             tokens_masked_classes(), ("dropout", "layernorm", "learned positions",
                                       "attention mask")),
        Arch("albert", E, "transformers.AlbertForMaskedLM",
             encoder(T.AlbertForMaskedLM, T.AlbertConfig, embedding_size=8, num_hidden_layers=2),
             tokens_masked_lm(), ("dropout", "tied embeddings", "layernorm",
                                  "factorized embeddings", "shared layers", "attention mask")),
        Arch("electra", E, "transformers.ElectraForSequenceClassification",
             encoder(T.ElectraForSequenceClassification, T.ElectraConfig, embedding_size=8),
             tokens_classes(), ("dropout", "layernorm", "factorized embeddings")),
        Arch("deberta_v2", E, "transformers.DebertaV2ForMaskedLM",
             encoder(T.DebertaV2ForMaskedLM, T.DebertaV2Config, relative_attention=True,
                     pos_att_type=["p2c", "c2p"], position_buckets=8, max_relative_positions=16,
                     position_biased_input=False, norm_rel_ebd="layer_norm", share_att_key=True),
             tokens_masked_lm(), ("dropout", "tied embeddings", "layernorm",
                                  "relative positions", "attention mask")),
        Arch("deberta", E, "transformers.DebertaForSequenceClassification",
             encoder(T.DebertaForSequenceClassification, T.DebertaConfig, relative_attention=True,
                     pos_att_type=["c2p", "p2c"], max_relative_positions=16),
             tokens_classes(), ("dropout", "layernorm", "relative positions")),
        Arch("xlm_roberta", E, "transformers.XLMRobertaForSequenceClassification",
             encoder(T.XLMRobertaForSequenceClassification, T.XLMRobertaConfig,
                     max_position_embeddings=20, pad_token_id=1, bos_token_id=0, eos_token_id=1),
             tokens_masked_classes(), ("dropout", "layernorm", "learned positions",
                                       "attention mask")),
        Arch("mpnet", E, "transformers.MPNetForMaskedLM",
             encoder(T.MPNetForMaskedLM, T.MPNetConfig, max_position_embeddings=20,
                     pad_token_id=1, bos_token_id=0,
                     eos_token_id=1),
             tokens_masked_lm(), ("dropout", "tied embeddings", "layernorm",
                                  "relative positions", "attention mask")),
        Arch("funnel", E, "transformers.FunnelForSequenceClassification",
             hf(T.FunnelForSequenceClassification, T.FunnelConfig, vocab_size=VOCAB,
                block_sizes=[1, 1], d_model=16, n_head=2, d_head=8, d_inner=32,
                hidden_dropout=0.1, attention_dropout=0.1, activation_dropout=0.1, num_labels=3),
             tokens_classes(), ("dropout", "layernorm", "relative positions", "pooling")),
        Arch("squeezebert", E, "transformers.SqueezeBertForSequenceClassification",
             encoder(T.SqueezeBertForSequenceClassification, T.SqueezeBertConfig,
                     embedding_size=16, q_groups=2, k_groups=2, v_groups=2,
                     post_attention_groups=1, intermediate_groups=2, output_groups=2),
             tokens_masked_classes(), ("dropout", "layernorm", "grouped conv",
                                       "attention mask")),
        Arch("ernie", E, "transformers.ErnieForMaskedLM",
             encoder(T.ErnieForMaskedLM, T.ErnieConfig),
             tokens_lm(), ("dropout", "tied embeddings", "layernorm", "learned positions")),
        Arch("roformer", E, "transformers.RoFormerForMaskedLM",
             encoder(T.RoFormerForMaskedLM, T.RoFormerConfig, embedding_size=16),
             tokens_masked_lm(), ("dropout", "tied embeddings", "layernorm", "rotary",
                                  "attention mask")),
        Arch("convbert", E, "transformers.ConvBertForSequenceClassification",
             encoder(T.ConvBertForSequenceClassification, T.ConvBertConfig, embedding_size=16,
                     conv_kernel_size=3),
             tokens_classes(), ("dropout", "layernorm", "depthwise conv", "span dynamic conv")),
        Arch("mobilebert", E, "transformers.MobileBertForMaskedLM",
             encoder(T.MobileBertForMaskedLM, T.MobileBertConfig, embedding_size=8,
                     intermediate_size=16, intra_bottleneck_size=8, true_hidden_size=8,
                     num_feedforward_networks=2),
             tokens_masked_lm(), ("dropout", "tied embeddings", "layernorm", "no-norm",
                                  "bottlenecks", "trigram input", "attention mask")),
        Arch("torch_transformer_encoder", E, "torch.nn.TransformerEncoder",
             torch_model(TokenClassifier),
             tokens_masked_classes(), ("dropout", "layernorm", "pre-norm", "key padding mask",
                                       "attention mask"),
             loss=tokens_loss),

        # ---- encoder-decoders
        Arch("t5", S, "transformers.T5ForConditionalGeneration",
             hf(T.T5ForConditionalGeneration, T.T5Config, vocab_size=VOCAB, d_model=16, d_kv=8,
                d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0),
             tokens_seq2seq(), ("dropout", "tied embeddings", "rmsnorm", "relative positions")),
        Arch("bart", S, "transformers.BartForConditionalGeneration",
             bart_like(T.BartForConditionalGeneration, T.BartConfig),
             tokens_seq2seq_masked(), ("dropout", "tied embeddings", "layernorm",
                                       "learned positions", "attention mask")),
        Arch("mbart", S, "transformers.MBartForConditionalGeneration",
             bart_like(T.MBartForConditionalGeneration, T.MBartConfig),
             tokens_seq2seq(), ("dropout", "tied embeddings", "layernorm", "pre-norm",
                                "learned positions")),
        Arch("pegasus", S, "transformers.PegasusForConditionalGeneration",
             bart_like(T.PegasusForConditionalGeneration, T.PegasusConfig),
             tokens_seq2seq_masked(), ("dropout", "tied embeddings", "layernorm",
                                       "sinusoidal positions", "attention mask")),
        Arch("marian", S, "transformers.MarianMTModel",
             bart_like(T.MarianMTModel, T.MarianConfig, decoder_vocab_size=VOCAB,
                       decoder_start_token_id=0),
             tokens_seq2seq(), ("dropout", "tied embeddings", "layernorm",
                                "sinusoidal positions")),
        Arch("blenderbot_small", S, "transformers.BlenderbotSmallForConditionalGeneration",
             bart_like(T.BlenderbotSmallForConditionalGeneration, T.BlenderbotSmallConfig),
             tokens_seq2seq_masked(), ("dropout", "tied embeddings", "layernorm",
                                       "learned positions", "attention mask")),
        Arch("m2m_100", S, "transformers.M2M100ForConditionalGeneration",
             bart_like(T.M2M100ForConditionalGeneration, T.M2M100Config, encoder_layerdrop=0.0,
                       decoder_layerdrop=0.0),
             tokens_seq2seq(), ("dropout", "tied embeddings", "layernorm",
                                "sinusoidal positions")),
        Arch("led", S, "transformers.LEDForConditionalGeneration",
             bart_like(T.LEDForConditionalGeneration, T.LEDConfig,
                       max_encoder_position_embeddings=16, max_decoder_position_embeddings=16,
                       attention_window=4),
             tokens_seq2seq(), ("dropout", "tied embeddings", "layernorm", "sliding window",
                                "decisions on values"),
             find_unused=True),
        Arch("mt5", S, "transformers.MT5ForConditionalGeneration",
             hf(T.MT5ForConditionalGeneration, T.MT5Config, vocab_size=VOCAB, d_model=16, d_kv=8,
                d_ff=32, num_layers=1, num_heads=2, pad_token_id=0, eos_token_id=1,
                decoder_start_token_id=0),
             tokens_seq2seq_masked(), ("dropout", "tied embeddings", "rmsnorm",
                                       "relative positions", "gated gelu", "attention mask")),
        Arch("umt5", S, "transformers.UMT5ForConditionalGeneration",
             hf(T.UMT5ForConditionalGeneration, T.UMT5Config, vocab_size=VOCAB, d_model=16,
                d_kv=8, d_ff=32, num_layers=1, num_heads=2, relative_attention_num_buckets=8,
                pad_token_id=0, eos_token_id=1, decoder_start_token_id=0),
             tokens_seq2seq(), ("dropout", "tied embeddings", "rmsnorm", "relative positions",
                                "gated gelu")),

        # ---- vision (image classification)
        Arch("vit", V, "transformers.ViTForImageClassification",
             hf(T.ViTForImageClassification, T.ViTConfig, hidden_size=16, num_hidden_layers=1,
                num_attention_heads=2, intermediate_size=32, image_size=8, patch_size=4,
                num_labels=3, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1),
             images_classes(8), ("dropout", "layernorm", "patch embedding")),
        Arch("deit", V, "transformers.DeiTForImageClassification",
             vit_like(T.DeiTForImageClassification, T.DeiTConfig),
             images_classes(16), ("dropout", "layernorm", "patch embedding",
                                  "distillation token")),
        Arch("beit", V, "transformers.BeitForImageClassification",
             vit_like(T.BeitForImageClassification, T.BeitConfig, use_relative_position_bias=True,
                      use_mean_pooling=True, layer_scale_init_value=0.1, drop_path_rate=0.1),
             images_classes(16), ("dropout", "layernorm", "patch embedding",
                                  "relative positions", "layer scale", "drop path")),
        Arch("vit_msn", V, "transformers.ViTMSNForImageClassification",
             vit_like(T.ViTMSNForImageClassification, T.ViTMSNConfig),
             images_classes(16), ("dropout", "layernorm", "patch embedding")),
        Arch("dinov2", V, "transformers.Dinov2ForImageClassification",
             vit_like(T.Dinov2ForImageClassification, T.Dinov2Config, mlp_ratio=2,
                      drop_path_rate=0.1),
             images_classes(16), ("dropout", "layernorm", "patch embedding", "layer scale",
                                  "drop path", "unused mask token"),
             find_unused=True),
        Arch("swin", V, "transformers.SwinForImageClassification",
             hf(T.SwinForImageClassification, T.SwinConfig, image_size=16, patch_size=2,
                embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4, mlp_ratio=2.0,
                num_labels=3, drop_path_rate=0.1, **DROP),
             images_classes(16), ("dropout", "layernorm", "patch embedding",
                                  "relative positions", "shifted windows", "patch merging",
                                  "drop path")),
        Arch("convnext", V, "transformers.ConvNextForImageClassification",
             hf(T.ConvNextForImageClassification, T.ConvNextConfig, num_stages=2,
                hidden_sizes=[8, 16], depths=[1, 1], drop_path_rate=0.1, num_labels=3),
             images_classes(32), ("layernorm", "depthwise conv", "layer scale", "drop path")),
        Arch("convnextv2", V, "transformers.ConvNextV2ForImageClassification",
             hf(T.ConvNextV2ForImageClassification, T.ConvNextV2Config, num_stages=2,
                hidden_sizes=[8, 16], depths=[1, 1], drop_path_rate=0.1, num_labels=3),
             images_classes(32), ("layernorm", "depthwise conv", "global response norm",
                                  "drop path")),
        Arch("resnet", V, "transformers.ResNetForImageClassification",
             hf(T.ResNetForImageClassification, T.ResNetConfig, embedding_size=8,
                hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3),
             images_classes(32), ("batchnorm", "residual", "max pool")),
        Arch("regnet", V, "transformers.RegNetForImageClassification",
             hf(T.RegNetForImageClassification, T.RegNetConfig, embedding_size=8,
                hidden_sizes=[8, 16], depths=[1, 1], groups_width=8, num_labels=3),
             images_classes(32), ("batchnorm", "grouped conv", "squeeze-excitation")),
        Arch("mobilenet_v1", V, "transformers.MobileNetV1ForImageClassification",
             hf(T.MobileNetV1ForImageClassification, T.MobileNetV1Config, image_size=32,
                depth_multiplier=0.25, classifier_dropout_prob=0.1, num_labels=3),
             images_classes(32), ("dropout", "batchnorm", "depthwise conv", "tf padding")),
        Arch("mobilenet_v2", V, "transformers.MobileNetV2ForImageClassification",
             hf(T.MobileNetV2ForImageClassification, T.MobileNetV2Config, image_size=32,
                depth_multiplier=0.25, classifier_dropout_prob=0.1, num_labels=3),
             images_classes(32), ("dropout", "batchnorm", "depthwise conv",
                                  "inverted residual", "tf padding")),
        Arch("efficientnet", V, "transformers.EfficientNetForImageClassification",
             unit_batchnorms(hf(
                 T.EfficientNetForImageClassification, T.EfficientNetConfig, image_size=32,
                 width_coefficient=0.125, depth_coefficient=1.0, kernel_sizes=[3, 3, 5],
                 in_channels=[32, 16, 24], out_channels=[16, 24, 40], strides=[1, 2, 2],
                 num_block_repeats=[1, 1, 1], expand_ratios=[1, 6, 6], hidden_dim=160,
                 dropout_rate=0.1, drop_connect_rate=0.1, num_labels=3)),
             images_classes(32), ("dropout", "batchnorm", "depthwise conv",
                                  "squeeze-excitation", "drop path")),
        Arch("levit", V, "transformers.LevitForImageClassification",
             hf(T.LevitForImageClassification, T.LevitConfig, image_size=64, patch_size=16,
                hidden_sizes=[16, 32], num_attention_heads=[2, 2], depths=[1, 1],
                key_dim=[8, 8], mlp_ratio=[2, 2], attention_ratio=[2, 2],
                down_ops=[["Subsample", 8, 2, 4, 2, 2]], num_labels=3),
             images_classes(64), ("batchnorm", "attention biases", "hardswish")),
        Arch("poolformer", V, "transformers.PoolFormerForImageClassification",
             hf(T.PoolFormerForImageClassification, T.PoolFormerConfig, hidden_sizes=[8, 16],
                depths=[1, 1], patch_sizes=[7, 3], strides=[4, 2], padding=[2, 1],
                num_encoder_blocks=2, drop_path_rate=0.1, num_labels=3),
             images_classes(32), ("groupnorm", "avg pool mixer", "layer scale", "drop path")),
        Arch("cvt", V, "transformers.CvtForImageClassification",
             hf(T.CvtForImageClassification, T.CvtConfig, embed_dim=[8, 16], num_heads=[1, 2],
                depth=[1, 2], patch_sizes=[7, 3], patch_stride=[4, 2], patch_padding=[2, 1],
                mlp_ratio=[2.0, 2.0], attention_drop_rate=[0.1, 0.1], drop_rate=[0.1, 0.1],
                drop_path_rate=[0.0, 0.1], qkv_bias=[True, True], cls_token=[False, True],
                qkv_projection_method=["dw_bn", "dw_bn"], kernel_qkv=[3, 3],
                padding_kv=[1, 1], stride_kv=[2, 2], padding_q=[1, 1], stride_q=[1, 1],
                num_labels=3),
             images_classes(32), ("dropout", "batchnorm", "layernorm", "depthwise conv",
                                  "conv attention", "drop path")),
        Arch("mobilevit", V, "transformers.MobileViTForImageClassification",
             unit_batchnorms(hf(
                 T.MobileViTForImageClassification, T.MobileViTConfig, image_size=32,
                 hidden_sizes=[16, 16, 16], neck_hidden_sizes=[8, 8, 16, 16, 16, 16, 32],
                 num_attention_heads=2, expand_ratio=2.0, attention_probs_dropout_prob=0.1,
                 num_labels=3)),
             images_classes(32), ("dropout", "batchnorm", "layernorm", "depthwise conv",
                                  "unfolded patches")),
        Arch("torchvision_resnet18", V, "torchvision.models.resnet18 (from torch.nn)",
             torch_model(ResNet), images_classes(32),
             ("batchnorm", "in-place add", "in-place relu", "max pool"), loss=images_loss),
        Arch("torchvision_mobilenet_v3_small", V,
             "torchvision.models.mobilenet_v3_small (from torch.nn)",
             torch_model(MobileNetV3Small), images_classes(32),
             ("dropout", "batchnorm", "depthwise conv", "squeeze-excitation", "hardswish",
              "in-place activations"), loss=images_loss),
        Arch("unet_2d", V, "diffusers.UNet2DModel",
             unet_2d, images_noise(8),
             ("dropout", "groupnorm", "timestep embedding", "skip connections", "upsampling"),
             loss=denoising_loss),

        # ---- audio
        Arch("whisper", Kind.AUDIO, "transformers.WhisperForConditionalGeneration",
             hf(T.WhisperForConditionalGeneration, T.WhisperConfig, vocab_size=VOCAB,
                num_mel_bins=8, d_model=16, encoder_layers=1, decoder_layers=1,
                encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                decoder_ffn_dim=32, max_source_positions=8, max_target_positions=16,
                dropout=0.1, attention_dropout=0.1, activation_dropout=0.1, pad_token_id=0,
                decoder_start_token_id=1, bos_token_id=1, eos_token_id=2, suppress_tokens=None,
                begin_suppress_tokens=None),
             audio_seq2seq(8, 16, 6), ("dropout", "tied embeddings", "layernorm", "conv1d",
                                       "sinusoidal positions")),
        Arch("wav2vec2", Kind.AUDIO, "transformers.Wav2Vec2ForCTC",
             hf(T.Wav2Vec2ForCTC, T.Wav2Vec2Config, vocab_size=16, hidden_size=16,
                num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                conv_dim=(8, 8), conv_stride=(4, 2), conv_kernel=(8, 4),
                num_feat_extract_layers=2, num_conv_pos_embeddings=4,
                num_conv_pos_embedding_groups=2, mask_time_prob=0.0, pad_token_id=0),
             waveform_ctc(), ("dropout", "layernorm", "groupnorm", "conv1d", "ctc loss",
                              "layerdrop", "weight norm")),
        Arch("hubert", Kind.AUDIO, "transformers.HubertForSequenceClassification",
             hf(T.HubertForSequenceClassification, T.HubertConfig, **WAVE, mask_time_prob=0.0,
                layerdrop=0.0, feat_proj_dropout=0.1, classifier_proj_size=8, num_labels=3),
             waveform_classes(), ("dropout", "layernorm", "groupnorm", "conv1d", "weight norm",
                                  "mean pooling")),
        Arch("data2vec_audio", Kind.AUDIO, "transformers.Data2VecAudioForSequenceClassification",
             hf(T.Data2VecAudioForSequenceClassification, T.Data2VecAudioConfig,
                **{**WAVE, "num_conv_pos_embeddings": 2}, conv_pos_kernel_size=3,
                mask_time_prob=0.0, layerdrop=0.0, feat_proj_dropout=0.1,
                classifier_proj_size=8, num_labels=3),
             waveform_classes(), ("dropout", "layernorm", "conv1d", "mean pooling")),
        Arch("wavlm", Kind.AUDIO, "transformers.WavLMForSequenceClassification",
             hf(T.WavLMForSequenceClassification, T.WavLMConfig, **WAVE, num_buckets=16,
                max_bucket_distance=32, mask_time_prob=0.0, layerdrop=0.0,
                feat_proj_dropout=0.1, classifier_proj_size=8, num_labels=3),
             waveform_classes(), ("dropout", "layernorm", "groupnorm", "conv1d", "weight norm",
                                  "relative positions", "gated relative bias")),
        Arch("audio_spectrogram_transformer", Kind.AUDIO, "transformers.ASTForAudioClassification",
             hf(T.ASTForAudioClassification, T.ASTConfig, hidden_size=16, num_hidden_layers=1,
                num_attention_heads=2, intermediate_size=32, patch_size=4, frequency_stride=4,
                time_stride=4, max_length=16, num_mel_bins=16, num_labels=3, **DROP),
             spectrogram_classes(16, 16), ("dropout", "layernorm", "patch embedding",
                                           "distillation token")),
        Arch("speech_to_text", Kind.AUDIO, "transformers.Speech2TextForConditionalGeneration",
             bart_like(T.Speech2TextForConditionalGeneration, T.Speech2TextConfig,
                       max_source_positions=16,
                       max_target_positions=16, conv_channels=16, input_feat_per_channel=8,
                       conv_kernel_sizes=[5, 5], num_conv_layers=2),
             audio_seq2seq(8, 16, 5, channels_first=False),
             ("dropout", "tied embeddings", "layernorm", "conv1d", "glu",
              "sinusoidal positions")),

        # ---- mixtures of experts (an expert no token is routed to gets no gradient)
        Arch("mixtral", Kind.MOE, "transformers.MixtralForCausalLM",
             hf(T.MixtralForCausalLM, T.MixtralConfig, vocab_size=VOCAB, hidden_size=16,
                intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
                max_position_embeddings=16),
             tokens_lm(), ("rmsnorm", "rotary", "grouped-query attention", "top-k routing",
                           "grouped mm"), find_unused=True),
        # experts routed by a loop over nonzero() rows, a decision on each (capture/decisions.py)
        Arch("qwen2_moe", Kind.MOE, "transformers.Qwen2MoeForCausalLM",
             hf(T.Qwen2MoeForCausalLM, T.Qwen2MoeConfig, vocab_size=VOCAB, hidden_size=16,
                intermediate_size=32, moe_intermediate_size=16,
                shared_expert_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                max_position_embeddings=16),
             tokens_lm(), ("rmsnorm", "rotary", "grouped-query attention", "top-k routing",
                           "shared expert", "decisions on values"), find_unused=True),
        # aten._grouped_mm in float32, met again by the functionalizing retrace (meta_fallback.py)
        Arch("deepseek_v3", Kind.MOE, "transformers.DeepseekV3ForCausalLM",
             hf(T.DeepseekV3ForCausalLM, T.DeepseekV3Config, vocab_size=VOCAB, hidden_size=16,
                intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
                first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2,
                n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                v_head_dim=8, max_position_embeddings=16),
             tokens_lm(), ("rmsnorm", "rotary", "multi-head latent attention",
                           "grouped top-k routing", "shared expert", "grouped mm"),
             find_unused=True),
        # its router assigns a module in forward (self.classifier = self.classifier.to(...)) and
        # multiplies its jitter noise (uniform_, drawn twice by torch's real-tensor propagation
        # until capture/real_twins.py) in place into a view of its input
        Arch("switch_transformers", Kind.MOE,
             "transformers.SwitchTransformersForConditionalGeneration",
             hf(T.SwitchTransformersForConditionalGeneration, T.SwitchTransformersConfig,
                vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2,
                num_decoder_layers=2, num_heads=2, num_experts=4, expert_capacity=8,
                num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
                decoder_start_token_id=0),
             tokens_seq2seq(), ("dropout", "tied embeddings", "rmsnorm", "relative positions",
                                "top-1 routing", "expert capacity", "router z-loss"),
             find_unused=True),
        Arch("qwen3_moe", Kind.MOE, "transformers.Qwen3MoeForCausalLM",
             decoder(T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig, moe_intermediate_size=16,
                     num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
                     norm_topk_prob=True, attention_dropout=0.1),
             tokens_masked_lm(), ("dropout", "rmsnorm", "rotary", "grouped-query attention",
                                  "qk norm", "top-k routing", "attention mask"),
             find_unused=True),
        Arch("olmoe", Kind.MOE, "transformers.OlmoeForCausalLM",
             decoder(T.OlmoeForCausalLM, T.OlmoeConfig, num_experts=4, num_experts_per_tok=2,
                     attention_dropout=0.1),
             tokens_lm(), ("dropout", "rmsnorm", "rotary", "qk norm", "top-k routing"),
             find_unused=True),
        Arch("granitemoe", Kind.MOE, "transformers.GraniteMoeForCausalLM",
             decoder(T.GraniteMoeForCausalLM, T.GraniteMoeConfig, num_local_experts=4,
                     num_experts_per_tok=2, attention_dropout=0.1, embedding_multiplier=12.0,
                     residual_multiplier=0.22, attention_multiplier=0.125, logits_scaling=4.0),
             tokens_lm(), ("dropout", "rmsnorm", "rotary", "top-k routing",
                           "scaling multipliers"),
             find_unused=True),
        Arch("gpt_oss", Kind.MOE, "transformers.GptOssForCausalLM",
             decoder(T.GptOssForCausalLM, T.GptOssConfig, num_hidden_layers=2,
                     intermediate_size=16, num_key_value_heads=1, head_dim=8,
                     num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                     layer_types=["sliding_attention", "full_attention"],
                     attention_dropout=0.1),
             tokens_lm(), ("dropout", "rmsnorm", "rotary", "grouped-query attention",
                           "sliding window", "attention sinks", "top-k routing",
                           "clamped swiglu"),
             find_unused=True),
        Arch("phimoe", Kind.MOE, "transformers.PhimoeForCausalLM",
             decoder(T.PhimoeForCausalLM, T.PhimoeConfig, num_key_value_heads=1,
                     num_local_experts=4, num_experts_per_tok=2, attention_dropout=0.1),
             tokens_lm(), ("dropout", "layernorm", "rotary", "grouped-query attention",
                           "sparsemixer routing", "router jitter"),
             find_unused=True),
        Arch("jamba", Kind.MOE, "transformers.JambaForCausalLM",
             decoder(T.JambaForCausalLM, T.JambaConfig, num_hidden_layers=2,
                     num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                     expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2,
                     attn_layer_offset=0, use_mamba_kernels=False, mamba_d_state=4,
                     mamba_d_conv=2, mamba_expand=2, mamba_dt_rank=4, attention_dropout=0.1),
             tokens_lm(), ("dropout", "rmsnorm", "grouped-query attention", "selective scan",
                           "hybrid attention/ssm", "top-k routing"),
             find_unused=True),

        # ---- state space models
        Arch("mamba", Kind.STATE_SPACE, "transformers.MambaForCausalLM",
             hf(T.MambaForCausalLM, T.MambaConfig, vocab_size=VOCAB, hidden_size=16,
                state_size=4, num_hidden_layers=2, expand=2, conv_kernel=2),
             tokens_lm(), ("tied embeddings", "rmsnorm", "selective scan", "causal conv1d")),
        Arch("mamba2", Kind.STATE_SPACE, "transformers.Mamba2ForCausalLM",
             hf(T.Mamba2ForCausalLM, T.Mamba2Config, vocab_size=VOCAB, hidden_size=16,
                num_heads=4, head_dim=8, state_size=4, num_hidden_layers=2, expand=2,
                n_groups=1, conv_kernel=2, chunk_size=8, time_step_rank=4, **IDS),
             tokens_lm(), ("rmsnorm", "gated rmsnorm", "chunked scan", "causal conv1d")),
        Arch("falcon_mamba", Kind.STATE_SPACE, "transformers.FalconMambaForCausalLM",
             hf(T.FalconMambaForCausalLM, T.FalconMambaConfig, vocab_size=VOCAB, hidden_size=16,
                intermediate_size=32, state_size=4, num_hidden_layers=2, expand=2,
                conv_kernel=2, time_step_rank=4, **IDS),
             tokens_lm(), ("tied embeddings", "rmsnorm", "selective scan", "causal conv1d")),
        Arch("recurrent_gemma", Kind.STATE_SPACE, "transformers.RecurrentGemmaForCausalLM",
             hf(T.RecurrentGemmaForCausalLM, T.RecurrentGemmaConfig, vocab_size=VOCAB,
                hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                block_types=["recurrent", "attention"], num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, lru_width=16, attention_window_size=8,
                conv1d_width=2, attention_dropout=0.1, **IDS),
             tokens_lm(), ("dropout", "tied embeddings", "rmsnorm", "linear recurrence",
                           "rotary", "logit softcap")),
        Arch("rwkv", Kind.STATE_SPACE, "transformers.RwkvForCausalLM",
             hf(T.RwkvForCausalLM, T.RwkvConfig, vocab_size=VOCAB, hidden_size=16,
                num_hidden_layers=2, attention_hidden_size=16, intermediate_size=32,
                context_length=16, bos_token_id=1, eos_token_id=1),
             tokens_lm(), ("layernorm", "token shift", "wkv recurrence")),

        # ---- multimodal
        Arch("clip", Kind.MULTIMODAL, "transformers.CLIPModel",
             hf(T.CLIPModel, T.CLIPConfig, projection_dim=16,
                text_config=dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 max_position_embeddings=16, attention_dropout=0.1,
                                 pad_token_id=0, bos_token_id=1, eos_token_id=2),
                vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, image_size=16, patch_size=4,
                                   attention_dropout=0.1)),
             tokens_images(8, 16), ("dropout", "layernorm", "0-d parameter",
                                    "contrastive loss", "attention mask", "argmax pooling")),
        Arch("siglip", Kind.MULTIMODAL, "transformers.SiglipModel",
             hf(T.SiglipModel, T.SiglipConfig,
                text_config=dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 max_position_embeddings=16, attention_dropout=0.1,
                                 projection_size=16, **IDS),
                vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, image_size=16, patch_size=4,
                                   attention_dropout=0.1)),
             tokens_images(8, 16), ("dropout", "layernorm", "sigmoid loss", "attention mask",
                                    "attention pooling head")),
        Arch("blip", Kind.MULTIMODAL, "transformers.BlipForConditionalGeneration",
             hf(T.BlipForConditionalGeneration, T.BlipConfig, projection_dim=16,
                text_config=dict(vocab_size=VOCAB, hidden_size=16, encoder_hidden_size=16,
                                 intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, max_position_embeddings=16,
                                 sep_token_id=1, **IDS, **DROP),
                vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, image_size=16, patch_size=4,
                                   attention_dropout=0.1)),
             images_captions(8, 16), ("dropout", "tied embeddings", "layernorm",
                                      "cross attention", "label smoothing")),

        # (appended: runs_of depends on the order) 16 experts, one per token, 8
        # tokens a rank: most experts get no token on a rank, and the ranks'
        # sets differ at every step (transpile's find_unused_parameters, as DDP's)
        Arch("qwen2_moe_sparse", Kind.MOE, "transformers.Qwen2MoeForCausalLM",
             hf(T.Qwen2MoeForCausalLM, T.Qwen2MoeConfig, vocab_size=VOCAB, hidden_size=16,
                intermediate_size=32, moe_intermediate_size=8,
                shared_expert_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, num_experts=16, num_experts_per_tok=1,
                max_position_embeddings=16),
             tokens_lm(4), ("rmsnorm", "rotary", "top-1 routing", "experts without tokens",
                            "decisions on values"), find_unused=True),
        Arch("word_language_model", D, "pytorch/examples word_language_model RNNModel (LSTM)",
             torch_model(WordLanguageModel), tokens_lm(9),
             ("dropout", "tied embeddings", "lstm", "sequence-first"), loss=sequence_lm_loss),
        Arch("seq2seq_gru", S, "pytorch/tutorials seq2seq translation (GRU, attention)",
             torch_model(Seq2SeqGRU), tokens_seq2seq(6, 5),
             ("dropout", "gru", "batch-first", "additive attention", "teacher forcing",
              "a layer called per step"), loss=seq2seq_loss),
        Arch("lstm_classifier", E, "nn.LSTM text classifier (bidirectional, batch-first)",
             torch_model(LSTMClassifier), tokens_classes(),
             ("dropout", "lstm", "bidirectional", "final states"), loss=tokens_classes_loss),

        # (appended) found by trying transformers' architectures not listed above.
        # find_unused: FNet's pooler, XLNet's mask embedding and ESM's contact head get
        # no gradient from a masked-LM loss, and the time-series models skip layers
        # (LayerDrop) on a rank's own draws.
        # PatchTST normalizes with BatchNorm1d between two transposes, and Qwen3-Next's
        # gated delta rule reads a softplus gate transposed: on CPU both kernels lay
        # their result out otherwise than the meta function (capture/kernel_layouts.py;
        # the program's view raised before it)
        Arch("patchtst", E, "transformers.PatchTSTForPretraining",
             hf(T.PatchTSTForPretraining, T.PatchTSTConfig, num_input_channels=2,
                context_length=16, patch_length=4, patch_stride=4, d_model=16,
                num_hidden_layers=1, num_attention_heads=2, ffn_dim=16, do_mask_input=True,
                mask_type="random", random_mask_ratio=0.4, dropout=0.1),
             series_channels(), ("dropout", "batchnorm", "random patch masking",
                                 "layouts the meta function misstates")),
        Arch("qwen3_next", Kind.MOE, "transformers.Qwen3NextForCausalLM",
             hf(T.Qwen3NextForCausalLM, T.Qwen3NextConfig, vocab_size=VOCAB, hidden_size=16,
                intermediate_size=32, moe_intermediate_size=8, shared_expert_intermediate_size=8,
                num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=8,
                linear_value_head_dim=8, linear_conv_kernel_dim=2, num_experts=4,
                num_experts_per_tok=2, decoder_sparse_step=1, max_position_embeddings=64,
                attention_dropout=0.1),
             tokens_lm(), ("rmsnorm", "rotary", "gated delta rule", "causal conv",
                           "top-k routing", "shared expert", "layouts the meta function misstates"),
             find_unused=True),
        Arch("fnet", E, "transformers.FNetForMaskedLM",
             hf(T.FNetForMaskedLM, T.FNetConfig, vocab_size=VOCAB, hidden_size=16,
                intermediate_size=32, num_hidden_layers=2, max_position_embeddings=16,
                hidden_dropout_prob=0.1),
             tokens_lm(), ("dropout", "fourier mixing (complex fft)", "tied embeddings"),
             find_unused=True),
        Arch("informer", S, "transformers.InformerForPrediction",
             hf(T.InformerForPrediction, T.InformerConfig, prediction_length=4, context_length=12,
                lags_sequence=[1, 2], num_time_features=2, d_model=16, encoder_layers=1,
                decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                encoder_ffn_dim=16, decoder_ffn_dim=16, dropout=0.1, sampling_factor=2),
             series_forecast(), ("dropout", "probsparse attention (randint samples)",
                                 "distilling conv", "student-t likelihood"), find_unused=True),
        Arch("time_series_transformer", S, "transformers.TimeSeriesTransformerForPrediction",
             hf(T.TimeSeriesTransformerForPrediction, T.TimeSeriesTransformerConfig,
                prediction_length=4, context_length=12, lags_sequence=[1, 2], num_time_features=2,
                d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, dropout=0.1),
             series_forecast(), ("dropout", "lagged inputs", "mean scaling",
                                 "student-t likelihood"), find_unused=True),
        Arch("patchtsmixer", E, "transformers.PatchTSMixerForPretraining",
             hf(T.PatchTSMixerForPretraining, T.PatchTSMixerConfig, num_input_channels=2,
                context_length=16, patch_length=4, patch_stride=4, d_model=16, num_layers=1,
                mask_type="random", random_mask_ratio=0.4, dropout=0.1, masked_loss=True),
             series_channels(), ("dropout", "random patch masking", "mlp mixing")),
        Arch("groupvit", Kind.MULTIMODAL, "transformers.GroupViTModel",
             hf(T.GroupViTModel, T.GroupViTConfig, projection_dim=16,
                projection_intermediate_dim=16,
                text_config=dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 max_position_embeddings=16),
                vision_config=dict(hidden_size=16, intermediate_size=32, depths=[1, 1],
                                   num_group_tokens=[4, 0], num_output_groups=[4, 4],
                                   num_attention_heads=2, image_size=16, patch_size=4,
                                   dropout=0.1)),
             tokens_images(), ("dropout", "hard gumbel-softmax grouping", "contrastive loss")),
        Arch("xlnet", D, "transformers.XLNetLMHeadModel",
             hf(T.XLNetLMHeadModel, T.XLNetConfig, vocab_size=VOCAB, d_model=16, n_layer=2,
                n_head=2, d_inner=32, dropout=0.1),
             tokens_lm(), ("dropout", "two-stream relative attention", "tied embeddings"),
             find_unused=True),
        Arch("modernbert", E, "transformers.ModernBertForMaskedLM",
             hf(T.ModernBertForMaskedLM, T.ModernBertConfig, vocab_size=VOCAB, hidden_size=16,
                intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                max_position_embeddings=64, global_attn_every_n_layers=2, local_attention=4,
                attention_dropout=0.1, mlp_dropout=0.1, embedding_dropout=0.1, pad_token_id=0,
                bos_token_id=1, eos_token_id=1, sep_token_id=1, cls_token_id=1),
             tokens_masked_lm(), ("dropout", "rotary", "local and global attention", "gated mlp",
                                  "attention mask")),
        Arch("esm", E, "transformers.EsmForMaskedLM",
             hf(T.EsmForMaskedLM, T.EsmConfig, vocab_size=VOCAB, hidden_size=16,
                intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=64, position_embedding_type="rotary",
                token_dropout=True, mask_token_id=3, pad_token_id=0, **DROP),
             tokens_masked_lm(), ("dropout", "rotary", "token dropout rescaled by the mask ratio",
                                  "attention mask"), find_unused=True),
        Arch("segformer", V, "transformers.SegformerForSemanticSegmentation",
             hf(T.SegformerForSemanticSegmentation, T.SegformerConfig, num_encoder_blocks=2,
                depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16], patch_sizes=[3, 3],
                strides=[2, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                decoder_hidden_size=16, num_labels=3, hidden_dropout_prob=0.1,
                drop_path_rate=0.1),
             images_segments(), ("dropout", "stochastic depth", "spatial-reduction attention",
                                 "batchnorm", "bilinear upsampling", "per-pixel loss")),
        Arch("bitnet", D, "transformers.BitNetForCausalLM",
             hf(T.BitNetForCausalLM, T.BitNetConfig, vocab_size=VOCAB, hidden_size=16,
                intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=64, attention_dropout=0.1),
             tokens_lm(), ("dropout", "rmsnorm", "rotary", "sub-layer norms")),
        Arch("jetmoe", Kind.MOE, "transformers.JetMoeForCausalLM",
             decoder(T.JetMoeForCausalLM, T.JetMoeConfig, num_key_value_heads=2, kv_channels=8,
                     num_local_experts=4, num_experts_per_tok=2, attention_dropout=0.1),
             tokens_lm(), ("dropout", "rmsnorm", "rotary", "mixture of attention heads",
                           "top-k routing"), find_unused=True),
        Arch("deepseek_v2", Kind.MOE, "transformers.DeepseekV2ForCausalLM",
             hf(T.DeepseekV2ForCausalLM, T.DeepseekV2Config, vocab_size=VOCAB, hidden_size=16,
                intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
                first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2,
                n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                topk_group=1, topk_method="group_limited_greedy", kv_lora_rank=8,
                q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                max_position_embeddings=64, attention_dropout=0.1),
             tokens_lm(), ("dropout", "rmsnorm", "multi-head latent attention",
                           "group-limited routing", "shared expert"), find_unused=True),
        Arch("nllb_moe", Kind.MOE, "transformers.NllbMoeForConditionalGeneration",
             hf(T.NllbMoeForConditionalGeneration, T.NllbMoeConfig, vocab_size=VOCAB, d_model=16,
                encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_experts=4,
                expert_capacity=8, encoder_sparse_step=2, decoder_sparse_step=2,
                max_position_embeddings=64, dropout=0.1, moe_token_dropout=0.2,
                decoder_start_token_id=0, pad_token_id=1),
             tokens_seq2seq(), ("dropout", "top-2 routing", "expert capacity",
                                "expert token dropout", "sinusoidal positions"), find_unused=True),
        Arch("gemma3n", D, "transformers.Gemma3nForCausalLM",
             hf(T.Gemma3nForCausalLM, T.Gemma3nTextConfig, vocab_size=VOCAB,
                vocab_size_per_layer_input=VOCAB, hidden_size=16, hidden_size_per_layer_input=4,
                intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8,
                layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                num_kv_shared_layers=0, activation_sparsity_pattern=[0.95, 0.0],
                altup_num_inputs=2, laurel_rank=4, max_position_embeddings=64,
                attention_dropout=0.1),
             tokens_lm(), ("dropout", "rmsnorm", "rotary", "altup", "laurel",
                           "per-layer embeddings", "activation sparsity (gaussian top-k)")),
        Arch("lfm2", D, "transformers.Lfm2ForCausalLM",
             hf(T.Lfm2ForCausalLM, T.Lfm2Config, vocab_size=VOCAB, hidden_size=16,
                intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, layer_types=["conv", "full_attention"],
                max_position_embeddings=64),
             tokens_lm(), ("rmsnorm", "rotary", "gated short convolution")),
        Arch("hiera", V, "transformers.HieraForImageClassification",
             hf(T.HieraForImageClassification, T.HieraConfig, embed_dim=8, image_size=[32, 32],
                patch_size=[3, 3], patch_stride=[2, 2], patch_padding=[1, 1], depths=[1, 1],
                num_heads=[1, 2], query_stride=[2, 2], masked_unit_size=[4, 4], num_query_pool=1,
                num_labels=3, drop_path_rate=0.1),
             images_classes(), ("stochastic depth", "mask-unit attention", "unroll and reroll",
                                "query pooling")),
        Arch("bit", V, "transformers.BitForImageClassification",
             hf(T.BitForImageClassification, T.BitConfig, embedding_size=8, hidden_sizes=[8, 16],
                depths=[1, 1], layer_type="preactivation", global_padding="SAME", num_groups=4,
                num_labels=3, drop_path_rate=0.1),
             images_classes(), ("stochastic depth", "weight standardization (batch norm of the "
                                "weights)", "groupnorm", "same padding")),
        Arch("upernet", V, "transformers.UperNetForSemanticSegmentation",
             hf(T.UperNetForSemanticSegmentation, T.UperNetConfig,
                backbone_config=T.ConvNextConfig(hidden_sizes=[8, 8, 16, 16], depths=[1, 1, 1, 1],
                                                 out_features=["stage1", "stage2", "stage3",
                                                               "stage4"]),
                hidden_size=16, auxiliary_in_channels=16, auxiliary_channels=8, num_labels=3,
                use_auxiliary_head=True),
             images_segments(), ("batchnorm", "pyramid pooling", "feature pyramid",
                                 "auxiliary head", "bilinear upsampling", "per-pixel loss")),
        Arch("timesformer", V, "transformers.TimesformerForVideoClassification",
             hf(T.TimesformerForVideoClassification, T.TimesformerConfig, image_size=16,
                patch_size=8, num_frames=4, hidden_size=16, num_hidden_layers=1,
                num_attention_heads=2, intermediate_size=32, num_labels=3,
                hidden_dropout_prob=0.1),
             video_classes(), ("dropout", "divided space-time attention")),
        Arch("minimax", Kind.MOE, "transformers.MiniMaxForCausalLM",
             decoder(T.MiniMaxForCausalLM, T.MiniMaxConfig,
                     layer_types=["linear_attention", "full_attention"], block_size=4,
                     num_hidden_layers=2, num_key_value_heads=1, head_dim=8, num_local_experts=4,
                     num_experts_per_tok=2, attention_dropout=0.1, max_position_embeddings=64),
             tokens_lm(), ("dropout", "rmsnorm", "rotary", "lightning attention (blocks)",
                           "top-k routing"), find_unused=True),
        Arch("granitemoehybrid", Kind.MOE, "transformers.GraniteMoeHybridForCausalLM",
             decoder(T.GraniteMoeHybridForCausalLM, T.GraniteMoeHybridConfig,
                     num_hidden_layers=2, num_key_value_heads=1, layer_types=["mamba", "attention"],
                     num_local_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_n_heads=2,
                     mamba_d_head=16, mamba_n_groups=1, mamba_chunk_size=4,
                     shared_intermediate_size=16, attention_dropout=0.1,
                     max_position_embeddings=64),
             tokens_lm(), ("dropout", "rmsnorm", "mamba2 (chunked scan)", "top-k routing",
                           "shared expert"), find_unused=True),
        Arch("big_bird_block_sparse", E, "transformers.BigBirdForMaskedLM",
             hf(T.BigBirdForMaskedLM, T.BigBirdConfig, attention_type="block_sparse",
                block_size=2, num_random_blocks=2, vocab_size=VOCAB, hidden_size=16,
                intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=64, **DROP),
             tokens_lm(32), ("dropout", "block-sparse attention", "random blocks"),
             refused=r"np\.random\.permutation",
             why="its random attention blocks are drawn with numpy and indexed on the host "
                 "every training call (np.random.permutation): the program would reuse the "
                 "first call's blocks; attention_type='original_full' trains"),
        Arch("reformer", D, "transformers.ReformerModelWithLMHead",
             hf(T.ReformerModelWithLMHead, T.ReformerConfig, vocab_size=VOCAB, hidden_size=16,
                feed_forward_size=32, attention_head_size=8, num_attention_heads=2,
                attn_layers=["local", "lsh"], axial_pos_embds=False, max_position_embeddings=16,
                local_attn_chunk_length=4, lsh_attn_chunk_length=4, num_buckets=2,
                is_decoder=True, hidden_dropout_prob=0.1, lsh_attention_probs_dropout_prob=0.1,
                local_attention_probs_dropout_prob=0.1),
             tokens_lm(16), ("dropout", "lsh attention", "reversible layers"),
             refused=r"torch\.seed\(\)",
             why="its reversible layers seed torch with torch.seed() in every training "
                 "forward (a nondeterministic seed, not reproducible in eager either)"),
    ]


def by_name(name: str) -> Arch:
    return next(a for a in catalogue() if a.name == name)


@dataclasses.dataclass(frozen=True)
class Run:
    arch: Arch
    mode: str
    backend: str


def runs_of(archs: list[Arch]) -> list[Run]:
    """fuse_all_reduce in eager for every architecture; zero and fsdp on every
    third (from the first), inductor on every third (from the second)."""
    runs = []
    for i, a in enumerate(archs):
        runs.append(Run(a, "fuse_all_reduce", "eager"))
        if i % 3 == 0:
            runs += [Run(a, "zero", "eager"), Run(a, "fsdp", "eager")]
        if i % 3 == 1:
            runs.append(Run(a, "fuse_all_reduce", "inductor"))
    return runs
