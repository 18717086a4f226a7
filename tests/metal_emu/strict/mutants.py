"""Copies of the flattened kernel source that Apple's compiler would reject:
each must fail the strict compile or the lint, for its own reason.

As ``tests/metal_emu/mutants.py``, a mutant is text edits, each matching the
source exactly once; here they edit the flattened text (one edit may reach the
parameter headers and the kernel header at once), and each says how it must fail:
("compile", a regex of clang's message) or ("lint", the rule).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    """Edits ``(original, replacement)`` of the source, and the failure expected."""

    edits: tuple[tuple[str, str], ...]
    check: str  # "compile" or "lint"
    expected: str  # clang's message (a regex) or the lint rule


MUTANTS = {
    # A load through a thread reference to device memory.
    "device_pointer_bound_to_thread_reference": Mutant(
        (("    return float(x[0]);\n", "    const thread T& first = x[0];\n    return float(first);\n"),),
        "compile", r"binding reference of type 'const \w+' to value of type 'device \w+ const' changes address space"),
    # A member function of no address space called on a request in device memory.
    "thread_member_function_on_device_object": Mutant(
        (("  int length;\n};", "  int length;\n  int bound() const { return length; }\n};"),
         ("requests[b].length", "requests[b].bound()")),
        "compile", r"cannot initialize object parameter of type 'const [\w:]*RaggedRequest' "
                   r"with an expression of type 'device [\w:]*RaggedRequest const'"),
    "double_local": Mutant(
        (("  const float m_all = max(m, sink);", "  const double m_all = max(m, sink);"),), "lint", "double"),
    # bda_weight -> bda_normalizer -> bda_weight.
    "recursion": Mutant(
        (("inline float bda_weight(float m, float m_max) {\n  return m == -bda_inf ? 0.0f : exp(m - m_max);",
          "inline float bda_normalizer(float m, float l, float sink);\n"
          "inline float bda_weight(float m, float m_max) {\n"
          "  return m == -bda_inf ? 0.0f : m_max < m ? bda_normalizer(m, 1.0f, m_max) : exp(m - m_max);"),),
        "lint", "recursion"),
    "function_pointer": Mutant(
        (("  const float f = bda_weight(m, m_all);",
          "  float (*weight)(float, float) = bda_weight;\n  const float f = weight(m, m_all);"),),
        "lint", "function_pointer"),
    "virtual_function": Mutant(
        (("struct BdaRow {", "struct BdaRowBase {\n  virtual bool holds() const { return true; }\n};\n"
          "struct BdaRow {"),), "lint", "virtual"),
    "exception": Mutant(
        (("  if (!p.has_ring_offset || p.seq_len == 0) {",
          "  if (p.seq_len < 0) {\n    throw p.seq_len;\n  }\n  if (!p.has_ring_offset || p.seq_len == 0) {"),),
        "lint", "exceptions"),
    "new_delete": Mutant(
        (("  const int r = ring_offsets[b * p.ring_stride] % p.seq_len;",
          "  int* scratch = new int(ring_offsets[b * p.ring_stride] % p.seq_len);\n"
          "  const int r = *scratch;\n  delete scratch;"),), "lint", "new_delete"),
    "thread_local": Mutant(
        (("constant float bda_inf =", "thread_local int bda_calls = 0;\nconstant float bda_inf ="),),
        "lint", "thread_local"),
    "static_local": Mutant(
        (("inline float bda_weight(float m, float m_max) {\n",
          "inline float bda_weight(float m, float m_max) {\n  static int calls = 0;\n  ++calls;\n"),),
        "lint", "static_local"),
    "rtti": Mutant(
        (("inline float bda_weight(float m, float m_max) {\n",
          "inline float bda_weight(float m, float m_max) {\n  (void)typeid(m);\n"),), "lint", "rtti"),
}


def mutant_text(text: str, name: str) -> str:
    """``text`` (the flattened kernel source) with mutant ``name``'s edits, each applied exactly once."""
    for original, replacement in MUTANTS[name].edits:
        assert text.count(original) == 1, f"{name}: {original!r} no longer matches the source exactly once"
        text = text.replace(original, replacement)
    return text
