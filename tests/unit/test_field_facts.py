"""What is known about a config field is declared beside it (pipeline/config.py, `knob`), and pipeline/runspec.py
derives its tables from those declarations: a new field cannot be left out of them unseen."""

from pipeline import runspec

SERVABLE = ("model", "sampling", "rewards", "generator")  # the sections whose fields a generator might be served


def test_every_field_a_generator_might_be_served_says_whether_it_is():
    undeclared = [key for key, facts in runspec.field_facts().items()
                  if key.split(".")[0] in SERVABLE and facts.get("generator") not in ("own", "served", "refused")]
    assert not undeclared, ("declare generator='own' (each generator's own value), 'served' (the run's) or 'refused' "
                            f"(the run's, and a generator that says otherwise is refused) on: {', '.join(undeclared)}")


def test_a_section_stands_for_its_fields_and_a_fact_on_a_section_holds_for_its_fields():
    facts = runspec.field_facts()
    assert "model" in runspec.REFUSED and "sampling" in runspec.SERVED and "model.lora.r" in facts
    assert "eval" in runspec.RESUMABLE and "model.lora.merged_final" in runspec.RESUMABLE
    served_under_eval = [k for k in facts if k.startswith("eval.") and runspec._under(k, runspec.SERVED)]
    assert facts["data.prompt_column"]["generator"] == "served" and not served_under_eval  # eval.data is the hub's
