import random

from lucekv.engine.stops import StopMatcher


def run(pieces, stops):
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        text, stopped = m.feed(p)
        out.append(text)
        if stopped:
            return "".join(out), True
    out.append(m.flush())
    return "".join(out), False


def test_stop_string_is_cut_and_never_leaked_whatever_the_split():
    text = "Hello world. The answer is 42.\nEND of story"
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 10)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert run(pieces, ["\nEND"]) == ("Hello world. The answer is 42.", True)


def test_earliest_of_several_stops_wins():
    assert run(["abc STOP2 xx STOP1"], ["STOP1", "STOP2"]) == ("abc ", True)


def test_partial_match_at_the_end_is_released():
    assert run(["value: EN"], ["END"]) == ("value: EN", False)


def test_no_stops_passes_everything():
    assert run(["a", "b"], []) == ("ab", False)
