//! Object keys as Go's `encoding/json` matches them: equal under Unicode simple case folding
//! (the orbits of `unicode.SimpleFold`, so `ſ` U+017F is `s` and the Kelvin sign U+212A is
//! `k`). Such a server fills a struct field from every key that folds to its name, the last
//! one winning, so two keys that fold together in one object let the gateway read one value
//! and the tool another.

use crate::parse::fold_table::FOLDS;

/// Unicode version the folding table was generated from.
pub use crate::parse::fold_table::UNICODE_VERSION;

/// Objects with more keys than this are checked by sorting folded copies instead of
/// comparing every pair; below it, no allocation at all.
const PAIRWISE_MAX: usize = 12;

/// One representative of `c`'s folding class: ASCII letters as lowercase, anything else as
/// the class's smallest member (lowercased when that is an ASCII letter, as for `ſ`).
fn fold_char(c: char) -> char {
    if c.is_ascii() {
        return c.to_ascii_lowercase();
    }
    match FOLDS.binary_search_by_key(&u32::from(c), |&(from, _)| from) {
        Ok(i) => FOLDS
            .get(i)
            .and_then(|&(_, to)| char::from_u32(to))
            .map_or(c, |to| to.to_ascii_lowercase()),
        Err(_) => c,
    }
}

/// Whether `a` and `b` are the same key to a case-folding decoder.
pub fn eq_fold(a: &str, b: &str) -> bool {
    if a.is_ascii() && b.is_ascii() {
        return a.eq_ignore_ascii_case(b);
    }
    a.chars().map(fold_char).eq(b.chars().map(fold_char))
}

/// `key` with every character replaced by its class representative.
pub fn fold(key: &str) -> String {
    key.chars().map(fold_char).collect()
}

/// Two distinct keys among `keys` (already free of exact duplicates) that fold together.
pub fn collision<'a, I>(keys: I) -> Option<(&'a str, &'a str)>
where
    I: ExactSizeIterator<Item = &'a str> + Clone,
{
    if keys.len() <= PAIRWISE_MAX {
        // ASCII keys fold together only when they differ in letter case alone; checking that
        // once for the object spares every pair the check.
        let ascii = keys.clone().all(str::is_ascii);
        let same = |a: &str, b: &str| {
            if ascii {
                a.eq_ignore_ascii_case(b)
            } else {
                eq_fold(a, b)
            }
        };
        let mut rest = keys.clone();
        while let Some(a) = rest.next() {
            if let Some(b) = rest.clone().find(|b| same(a, b)) {
                return Some((a, b));
            }
        }
        return None;
    }
    let mut folded: Vec<(String, &str)> = keys.map(|k| (fold(k), k)).collect();
    folded.sort_unstable();
    folded.windows(2).find_map(|w| match w {
        [(fa, a), (fb, b)] if fa == fb => Some((*a, *b)),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ascii_letters_fold_and_nothing_else_does() {
        assert!(eq_fold("method", "Method"));
        assert!(eq_fold("arguments", "ARGUMENTS"));
        assert!(eq_fold("_meta", "_Meta"));
        assert!(!eq_fold("method", "method_"));
        assert!(!eq_fold("a-b", "a_b"));
        assert!(
            !eq_fold("[", "{"),
            "0x5B and 0x7B differ only in bit 5 but are not letters"
        );
        assert!(!eq_fold("@", "`"));
    }

    #[test]
    fn long_s_and_kelvin_sign_fold_with_ascii() {
        assert!(eq_fold("params", "param\u{17F}"));
        assert!(eq_fold("PARAMS", "param\u{17F}"));
        assert!(eq_fold("kind", "\u{212A}ind"));
        assert!(eq_fold("Kind", "\u{212A}IND"));
        assert!(
            !eq_fold("kind", "\u{212B}ind"),
            "Angstrom sign folds with å, not k"
        );
    }

    #[test]
    fn non_ascii_classes_follow_simple_folding() {
        // Greek sigma has three members; micro sign, mu and capital mu are one class.
        assert!(eq_fold("\u{3A3}", "\u{3C3}") && eq_fold("\u{3C3}", "\u{3C2}"));
        assert!(eq_fold("\u{B5}", "\u{3BC}") && eq_fold("\u{B5}", "\u{39C}"));
        // Capital sharp s folds to ß (status S); only full folding would make it "ss".
        assert!(eq_fold("stra\u{DF}e", "STRA\u{1E9E}E"));
        assert!(!eq_fold("strasse", "stra\u{DF}e"));
        // Turkic dotted and dotless i have no simple folding to ASCII i (status T only).
        assert!(!eq_fold("id", "\u{130}d"));
        assert!(!eq_fold("id", "\u{131}d"));
        // Cherokee: the lowercase letters added in Unicode 8 fold to the uppercase ones.
        assert!(eq_fold("\u{13A0}", "\u{AB70}"));
        // Characters with no case stay themselves.
        assert!(!eq_fold("\u{4E00}", "\u{4E01}"));
    }

    #[test]
    fn the_table_is_sorted_and_maps_to_class_minimums() {
        assert!(FOLDS.windows(2).all(|w| w[0].0 < w[1].0));
        for &(from, to) in FOLDS {
            assert!(from >= 0x80 && to < from, "{from:X} -> {to:X}");
            // A class minimum is never itself remapped.
            assert!(FOLDS.binary_search_by_key(&to, |&(f, _)| f).is_err());
        }
    }

    #[test]
    fn collisions_are_found_in_small_and_large_objects() {
        let small = ["jsonrpc", "id", "method", "Method", "params"];
        assert_eq!(collision(small.iter().copied()), Some(("method", "Method")));
        assert_eq!(collision(["a", "b", "c"].iter().copied()), None);
        let mut large: Vec<String> = (0..100).map(|i| format!("key{i}")).collect();
        assert_eq!(collision(large.iter().map(String::as_str)), None);
        large.push("\u{212A}EY42".to_string());
        let (a, b) = collision(large.iter().map(String::as_str)).unwrap();
        let mut pair = [a, b];
        pair.sort_unstable();
        assert_eq!(pair, ["key42", "\u{212A}EY42"]);
    }
}
