"""Tiny Hugging Face checkpoints (random weights, locally trained BPE) so tests never touch a hub."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedConfig, Qwen2Config
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_PRETOKENIZE_REGEX

ARCHS = ("llama", "qwen2")
BOS, EOS, PAD, IM_START, IM_END = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|pad|>",
    "<|im_start|>",
    "<|im_end|>",
)
SPECIAL_TOKENS = (BOS, EOS, PAD, IM_START, IM_END)
# Every byte is a base token, so this is the smallest vocabulary that can encode any text.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
MAX_POSITION_EMBEDDINGS = 2048

# ChatML. The BOS is part of the template (as in Llama 3) because chat prompts are tokenized
# without special tokens, while plain completions get their BOS from the tokenizer.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The fan-in init gives logits of std ~1; this final-norm gain makes it ~4 (see _init_weights).
FINAL_NORM_GAIN = 4.0

CORPUS = """\
The morning train to the coast was late again, so Maria bought a coffee and watched the \
platform fill with commuters, students carrying heavy backpacks, and a man with a bicycle \
who kept checking his watch. When the train finally arrived, everyone squeezed inside, and \
the doors closed with a tired hiss.

To bake a simple loaf of bread, mix 500 grams of flour, 10 grams of salt, 7 grams of dry \
yeast and 350 millilitres of warm water. Knead the dough for ten minutes until it is smooth \
and elastic. Let it rise for an hour, shape it gently, then bake at 220 degrees Celsius for \
about thirty-five minutes. The crust should sound hollow when you tap the bottom.

A cache keeps recently used data close to where it is needed. When a request arrives, the \
server first looks for a matching entry; a hit avoids recomputing the result, while a miss \
forces the expensive path. Good eviction policies, such as least recently used, decide which \
blocks to discard when memory runs out. Hashing each block together with its parent makes \
prefixes cheap to compare.

In 1969, astronauts landed on the Moon and walked across a grey, dusty plain. Millions of \
people listened to the crackling radio voices. Decades later, robotic rovers explored Mars, \
measuring rocks, photographing ancient riverbeds and searching for signs of water.

"Are you coming to the concert tonight?" asked Tom.
"I wish I could," replied Aisha, "but I have to finish my report before Friday."
"Then let's meet for lunch on Saturday instead. I know a quiet place near the river."
"Perfect. I'll bring the photographs from our trip to the mountains."

Weather forecast: cloudy skies in the north with occasional showers, bright sunshine along \
the southern beaches, and strong winds over the hills. Temperatures will range from 12 to \
24 degrees. Tomorrow, a cold front brings thunderstorms, hail and a sharp drop in humidity.

Shopping list: apples, bananas, oranges, tomatoes, cucumbers, onions, garlic, olive oil, rice, \
lentils, cheese, yoghurt, eggs, honey, green tea, chocolate, batteries, envelopes, and a \
notebook with squared paper.

def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

The old library smelled of paper, dust and polished wood. Its shelves held atlases, novels, \
dictionaries and journals about botany, geology, music, economics, philosophy and medicine. \
Visitors whispered, turned pages slowly, and sometimes fell asleep in the leather armchairs \
by the tall windows overlooking the garden.

Scientists study how neurons communicate through electrical signals and chemical messengers. \
Each neuron may connect to thousands of others, forming networks that learn by strengthening \
or weakening their connections. Similar ideas inspired artificial neural networks, which \
transform numbers through layers of weighted sums and nonlinear functions.

Quick facts: the speed of light is about 299,792 kilometres per second; water boils at 100 \
degrees at sea level; a year has 365 days, or 366 in a leap year; and the human heart beats \
roughly 100,000 times every day.

Kubernetes schedules containers onto nodes, restarts them when they crash, and scales \
deployments up or down. Operators extend this behaviour with custom resources, reconciling \
the desired state written by users with the actual state observed in the cluster.

Why do cats purr? Nobody is entirely sure. They purr when content, but also when frightened, \
injured or giving birth. Some researchers believe the low vibration helps bones and tissues \
heal faster, which would be a remarkable evolutionary trick.

Dear committee, I am writing to recommend my former colleague for the position of senior \
engineer. During our years together she designed reliable systems, mentored junior staff, \
documented everything meticulously and remained calm during outages. Yours sincerely, Daniel.

The volcano erupted without warning, sending ash twelve kilometres into the sky. Villagers \
evacuated along narrow roads while helicopters surveyed glowing lava flows. Geologists later \
explained that magma had accumulated beneath the crater for several months.

Gardening tips: prune roses in early spring, water tomatoes deeply but rarely, mulch the beds \
to suppress weeds, and rotate vegetables yearly so that pests and diseases cannot establish \
themselves. Compost kitchen scraps, leaves and coffee grounds to enrich the soil naturally.

SELECT name, COUNT(*) AS orders FROM customers JOIN purchases USING (customer_id) \
WHERE created_at >= '2024-01-01' GROUP BY name ORDER BY orders DESC LIMIT 10;

The orchestra tuned their instruments while the audience settled. Violins, cellos, flutes, \
clarinets, trumpets and timpani filled the hall with a rich, shimmering chord. Then the \
conductor raised her baton, and the symphony began with a quiet, mysterious melody.

Football, basketball, tennis, swimming, cycling, climbing, rowing and chess each demand \
different skills: endurance, coordination, strategy, patience or sheer explosive strength. \
Coaches emphasise consistent practice, adequate sleep, balanced nutrition and recovery.

Economists debate inflation, unemployment, interest rates, taxation and trade. When central \
banks raise rates, borrowing becomes expensive, investment slows and prices eventually \
stabilise, although households with mortgages feel the squeeze immediately.

Legend tells of a fisherman who caught a golden fish that could speak. The fish promised \
three wishes in exchange for freedom. Greedy at first, the fisherman asked for a palace and \
treasure, but his final wish was simply to return home to his family and his small boat.

Installation guide: unpack the archive, open a terminal, run ./configure --prefix=/usr/local, \
then make and sudo make install. If compilation fails, check that gcc, cmake, pkg-config and \
zlib headers are present, and read config.log for the exact error.

Migratory birds navigate thousands of kilometres using the sun, the stars, landmarks and the \
Earth's magnetic field. Swallows, storks, cranes and arctic terns return each spring to the \
same nesting grounds, sometimes to the very same chimney or marsh.

The museum's newest exhibition displays Byzantine mosaics, Renaissance sketches, Japanese \
woodblock prints, Aztec obsidian knives and Victorian pocket watches, arranged chronologically \
across seven galleries with interactive touchscreens and multilingual audio guides.

Patient notes: fever of 38.5, persistent cough, mild headache, no known allergies. Prescribed \
rest, fluids and paracetamol; follow-up appointment scheduled in one week, or sooner if \
breathing becomes difficult or symptoms worsen overnight.

Quantum computers manipulate qubits that exist in superpositions, entangle them, and \
interfere amplitudes so that wrong answers cancel. Practical machines remain noisy, requiring \
error correction schemes that consume hundreds of physical qubits per logical qubit.

Zebras, giraffes, elephants, hippopotamuses, crocodiles, flamingos, vultures and cheetahs \
gathered near the shrinking waterhole. Tourists in jeeps photographed quietly, thrilled yet \
nervous, while rangers explained the delicate ecology of the savanna during drought.

Jazz musicians improvise over chord progressions, borrowing phrases, syncopating rhythms and \
answering each other's solos. Saxophone, trombone, double bass, piano and drums weave a \
conversation that is never played exactly the same way twice.
"""


class TinyModelError(ValueError):
    """A bad argument to `make_tiny_model`; `param` names the argument at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 512,
    llama3_rope_scaling: bool = False,
) -> Path:
    """Write a loadable LlamaForCausalLM / Qwen2ForCausalLM checkpoint with tokenizer to `out_dir`."""
    shape = _Shape(arch, num_layers, hidden_size, num_heads, num_kv_heads, vocab_size, llama3_rope_scaling)
    shape.check()
    tokenizer = train_tokenizer(vocab_size)
    special_ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    config = _model_config(shape, special_ids)
    # fork_rng keeps the caller's global RNG untouched while the seed fixes every weight.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _init_weights(model)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(), indent=2) + "\n")
    return out


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE on CORPUS with exactly `vocab_size` tokens; BOS is added to every encoding.

    transformers loads any `qwen2` checkpoint with Qwen2Tokenizer, which rebuilds the normalizer
    and pre-tokenizer (NFC, Qwen's split regex) whatever tokenizer.json says. Both archs use that
    pipeline, so tokenizer.json, AutoTokenizer and the engine agree on every id for either arch.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([CORPUS], trainer)
    reached = tokenizer.get_vocab_size()
    if reached != vocab_size:
        raise TinyModelError(
            "vocab_size",
            f"vocab_size={vocab_size} is too large: the built-in corpus yields at most {reached} tokens",
        )
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return tokenizer


@dataclass(frozen=True)
class _Shape:
    """The architecture knobs of a tiny checkpoint, checked before anything is written."""

    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    llama3_rope_scaling: bool

    def check(self) -> None:
        if self.arch not in ARCHS:
            raise TinyModelError("arch", f"arch={self.arch!r} is not one of {', '.join(ARCHS)}")
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads"):
            value = getattr(self, name)
            if value < 1:
                raise TinyModelError(name, f"{name}={value} must be at least 1")
        if self.hidden_size % self.num_heads:
            raise TinyModelError(
                "hidden_size", f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise TinyModelError(
                "num_heads", f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}"
            )
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise TinyModelError(
                "vocab_size",
                f"vocab_size={self.vocab_size} is too small: 256 byte tokens + {len(SPECIAL_TOKENS)} special "
                f"tokens need at least {MIN_VOCAB_SIZE}",
            )
        if self.llama3_rope_scaling and self.arch != "llama":
            raise TinyModelError(
                "llama3_rope_scaling", f"llama3 rope scaling is only for arch 'llama', not {self.arch!r}"
            )


def _model_config(shape: _Shape, special_ids: dict[str, int]) -> PreTrainedConfig:
    hidden_size = shape.hidden_size
    common = dict(
        vocab_size=shape.vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        # Fan-in scaled init: every projection of a unit-RMS input has ~unit-variance outputs, so
        # attention scores (q.k / sqrt(head_dim)) have std ~1 -- the softmax neither averages
        # uniformly nor picks one key -- and the residual stream grows only like sqrt(layers).
        initializer_range=hidden_size**-0.5,
        bos_token_id=special_ids[BOS],
        eos_token_id=special_ids[EOS],
        pad_token_id=special_ids[PAD],
    )
    # Theta and eps differ per arch (and from the transformers defaults) so an engine must read them.
    if shape.arch == "qwen2":
        return Qwen2Config(
            **common,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            tie_word_embeddings=True,
        )
    rope = {"rope_type": "default", "rope_theta": 10_000.0}
    if shape.llama3_rope_scaling:
        # original_max_position_embeddings is tiny so that, with head_dim 16, the slowest
        # frequencies fall in the scaled and interpolated bands at positions tests reach.
        rope.update(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=256,
        )
    return LlamaConfig(
        **common,
        rms_norm_eps=1e-5,
        rope_parameters=rope,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )


@torch.no_grad()
def _init_weights(model: torch.nn.Module) -> None:
    """Give norm gains and biases random values, and scale the final norm to spread the logits.

    transformers initializes gains to 1 and biases to 0, which would let an engine that never
    loads them pass every comparison. With the fan-in init alone the logits have std ~1: a flat
    distribution where the greedy pick and the top-5 hang on small gaps. Measured on 300-token
    random prompts (2 and 8 layers, hidden 64 and 256, both archs), the gain of 4 gives logits
    std 4.0-4.3, a median top-1/top-2 gap of ~1 and a median top-1 probability of ~0.45, with
    every activation finite.
    """
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.uniform_(0.5, 1.5)
        elif name.endswith(".bias"):
            param.normal_(0.0, 0.5)
    model.model.norm.weight.mul_(FINAL_NORM_GAIN)


def _tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        # Qwen2Tokenizer would otherwise add an "<|endoftext|>" unk token beyond the model's vocab.
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        # Cleanup would turn " ." into "." and break the text round trip.
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
