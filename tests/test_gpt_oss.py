

def test_slots_carry_each_layers_window():
    """Each attention slot's section holds its own window ('*' the section's, 'F' none), and depth pruning keeps
    them with their layers (the pattern's characters go with the layers)."""
    from remodel.compress.prune import drop_layers_config
    from tests.test_families import tiny_config
    cfg = tiny_config(FAMILY, "full_first_tied")
    assert cfg.pattern == "FE*E*E"
    assert [s.section.sliding_window for s in cfg.slots if s.kind.section_name == "attention"] == [None, 3, 3]
    kept = drop_layers_config(cfg, [2, 3])
    assert [s.section.sliding_window for s in kept.slots if s.kind.section_name == "attention"] == [None, 3]
