#!/usr/bin/env python3
"""Fails when a config key is declared but nothing reads it (issue 22).

Every key is declared once in trainer/config.cpp, `f("name", member, help)` in a fields()
visitor. A key that does something is read as `.member` by code outside trainer/config.{h,cpp}.
The few keys whose only effect is in config.cpp (refused unless at their one supported value,
or logged as a compatibility note) are listed below with why; each of those must be read by
config.cpp's validation or notes, outside the visitors, or declare its one allowed value in
its visitor entry (`{"nf4"}`, `Field::one_of({"none"}, ...)`: the engine refuses any other),
and must not be read elsewhere (then it does something and leaves the list).

Usage: config_keys_read.py SOURCE_DIR
"""
import pathlib
import re
import sys

# member -> what config.cpp does with it (its only effect).
ONLY_IN_CONFIG = {
    "llm_int8_has_fp16_weight": "false only (the 8-bit weights stay frozen)",
    "bnb_4bit_quant_storage": "uint8 only",
    "llm_int8_enable_fp32_cpu_offload": "false only (offloaded projections stay quantized)",
    "quant_method": "bitsandbytes only",
    "low_cpu_mem_usage": "true only (loads always stream from the mmapped safetensors)",
    "task_type": "CAUSAL_LM only",
    "use_reentrant": "compatibility note",
    "gradient_checkpointing_kwargs": "compatibility note (its one key)",
    "dataloader_pin_memory": "compatibility note",
    "dataloader_num_workers": "compatibility note",
    "remove_unused_columns": "compatibility note",
    "report_to": "none only (no experiment tracker)",
}

SOURCE_DIRS = ["tools", "trainer", "models", "data", "runtime", "examples"]


def strip_strings_and_comments(text):
    text = re.sub(r'"(?:\\.|[^"\\\n])*"', '""', text)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def main(root):
    root = pathlib.Path(root)
    config_cpp = (root / "trainer/config.cpp").read_text()
    config_h = (root / "trainer/config.h").read_text()
    # struct -> [(key, member)] from each fields() visitor.
    visitors = re.compile(r"template <class F>\s*void (\w+)::fields\(F&& f\) \{(.*?)\n\}", re.S)
    declared = {s: re.findall(r'\bf\("([A-Za-z0-9_]+)",\s*([A-Za-z0-9_]+)\s*[,)]', body)
                for s, body in visitors.findall(config_cpp)}
    # member -> its choices, when the visitor entry declares exactly one allowed value.
    single_choice = {}
    for body in visitors.findall(config_cpp):
        for entry in re.split(r"\n\s*f\(", body[1]):
            m = re.match(r'\s*"[A-Za-z0-9_]+",\s*(\w+),.*?(?:Field::one_of\(|,\s*)\{("[^"]*")\}', entry, re.S)
            if m:
                single_choice[m.group(1)] = m.group(2)
    if sum(len(v) for v in declared.values()) < 50:
        sys.exit("found too few f(\"name\", member) declarations in trainer/config.cpp: "
                 "has the visitor's form changed? update this test")
    # struct -> the member name it has inside its parent (ModelConfig -> model).
    section = {t: m for t, m in re.findall(r"^\s+(\w+Config) (\w+);", config_h, re.M)}
    config_rest = strip_strings_and_comments(visitors.sub("", config_cpp))

    others = []
    for d in SOURCE_DIRS:
        for p in sorted((root / d).rglob("*")):
            if p.suffix in (".cpp", ".h") and p.relative_to(root).as_posix() not in (
                    "trainer/config.cpp", "trainer/config.h"):
                others.append(strip_strings_and_comments(p.read_text()))
    elsewhere = "\n".join(others)

    def reads(text, struct, member):
        # `<x>.<section>.member`, or `v.member` where v is declared as the struct or bound to the section.
        owners = [r"\." + section.get(struct, struct)]
        for v in set(re.findall(r"\b" + struct + r"\s*&?\s+(\w+)\s*[=;,)]", text)) | set(
                re.findall(r"\bauto\s*&?\s+(\w+)\s*=\s*[\w.]*\." + section.get(struct, "@") + r"\s*;", text)):
            owners.append(r"\b" + v)
        return re.search("(?:" + "|".join(owners) + r")\." + re.escape(member) + r"\b(?!\s*\()", text)

    problems = []
    count = 0
    for struct, fields in declared.items():
        for name, member in fields:
            count += 1
            read_elsewhere = any(reads(t, struct, member) for t in others)
            if member in ONLY_IN_CONFIG:
                if read_elsewhere:
                    problems.append(f"{name}: read outside config.cpp now; remove it from ONLY_IN_CONFIG")
                elif not reads(config_rest, struct, member) and member not in single_choice:
                    problems.append(f"{name}: listed as '{ONLY_IN_CONFIG[member]}' but config.cpp's "
                                    "validation and notes never read it")
            elif not read_elsewhere:
                problems.append(f"{name} ({struct}::{member}): declared in trainer/config.cpp but read by no "
                                "code outside trainer/config.{h,cpp}: make it work, or refuse values other than "
                                "its default in validate() and list it in ONLY_IN_CONFIG")
    for p in problems:
        print("FAIL " + p)
    print(f"{count} keys declared, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
