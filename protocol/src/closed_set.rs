//! Closed sets (denial codes, attempt states, guard modes, acks, …) written as one table each.
//!
//! A closed set is a fixed list of names that cross a boundary: JSON on the wire, a stored
//! column, a metric label. Written by hand, each one grew parallel lists (the enum, an `ALL`
//! array, a `match` to its name, a `match` to its number) that compile while one of them
//! misses a row. [`closed_set!`](crate::closed_set) takes one row per variant (the variant,
//! its wire name and, when the set has one, the value of one more column) and derives the rest:
//!
//! - the enum itself, with the attributes and derives given (never serde's: see below);
//! - `ALL`, every variant in table order, and `NAMES`, their wire names in the same order;
//! - `as_str` (the wire name), `from_wire` (its inverse), and [`Display`](std::fmt::Display);
//! - `Serialize`/`Deserialize` as the wire name, so serde can never spell a variant another way
//!   (an unknown name is refused with serde's usual `unknown variant` error);
//! - with a column (`enum Name: column -> Type`), a `const fn column(self) -> Type`.

/// Defines a closed set from one table; see the [module docs](crate::closed_set).
///
/// ```
/// atmost_protocol::closed_set! {
///     /// How loud a thing is.
///     #[derive(Debug, Clone, Copy, PartialEq, Eq)]
///     pub enum Volume: decibels -> u8 {
///         Quiet => "quiet", 20;
///         Loud => "loud", 90;
///     }
/// }
/// assert_eq!(Volume::Loud.as_str(), "loud");
/// assert_eq!(Volume::from_wire("quiet"), Some(Volume::Quiet));
/// assert_eq!(Volume::Loud.decibels(), 90);
/// assert_eq!(Volume::NAMES, ["quiet", "loud"]);
/// ```
#[macro_export]
macro_rules! closed_set {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident : $column:ident -> $column_ty:ty {
            $( $(#[$vmeta:meta])* $variant:ident => $wire:literal, $value:expr; )+
        }
    ) => {
        $crate::closed_set! {
            $(#[$meta])*
            $vis enum $name {
                $( $(#[$vmeta])* $variant => $wire; )+
            }
        }

        impl $name {
            #[allow(dead_code)]
            pub const fn $column(self) -> $column_ty {
                match self {
                    $( $name::$variant => $value, )+
                }
            }
        }
    };
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident => $wire:literal; )+
        }
    ) => {
        $(#[$meta])*
        $vis enum $name {
            $( $(#[$vmeta])* $variant, )+
        }

        impl $name {
            /// Every variant, in table order.
            #[allow(dead_code)]
            pub const ALL: [$name; [$($wire),+].len()] = [$($name::$variant),+];

            /// Every wire name, in table order.
            #[allow(dead_code)]
            pub const NAMES: [&'static str; [$($wire),+].len()] = [$($wire),+];

            /// The name on the wire (JSON, stored columns, metric labels).
            pub const fn as_str(self) -> &'static str {
                match self {
                    $( $name::$variant => $wire, )+
                }
            }

            /// The variant with this wire name, if any.
            #[allow(dead_code)]
            pub fn from_wire(name: &str) -> Option<$name> {
                match name {
                    $( $wire => Some($name::$variant), )+
                    _ => None,
                }
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl $crate::__serde::Serialize for $name {
            fn serialize<S: $crate::__serde::Serializer>(
                &self,
                serializer: S,
            ) -> ::std::result::Result<S::Ok, S::Error> {
                serializer.serialize_str(self.as_str())
            }
        }

        impl<'de> $crate::__serde::Deserialize<'de> for $name {
            fn deserialize<D: $crate::__serde::Deserializer<'de>>(
                deserializer: D,
            ) -> ::std::result::Result<Self, D::Error> {
                struct WireName;
                impl $crate::__serde::de::Visitor<'_> for WireName {
                    type Value = $name;
                    fn expecting(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                        f.write_str("variant identifier")
                    }
                    fn visit_str<E: $crate::__serde::de::Error>(
                        self,
                        name: &str,
                    ) -> ::std::result::Result<$name, E> {
                        $name::from_wire(name).ok_or_else(|| E::unknown_variant(name, &$name::NAMES))
                    }
                }
                deserializer.deserialize_str(WireName)
            }
        }
    };
}

#[cfg(test)]
mod tests {
    crate::closed_set! {
        /// A set with a column.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        enum Coin: cents -> u32 {
            Penny => "penny", 1;
            /// Five of them.
            Nickel => "nickel", 5;
        }
    }

    crate::closed_set! {
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        enum Side {
            Heads => "heads";
            Tails => "tails";
        }
    }

    #[test]
    fn every_row_reads_back_from_its_name() {
        for coin in Coin::ALL {
            assert_eq!(Coin::from_wire(coin.as_str()), Some(coin));
            assert_eq!(coin.to_string(), coin.as_str());
        }
        assert_eq!(Coin::NAMES, ["penny", "nickel"]);
        assert_eq!(Coin::Nickel.cents(), 5);
        assert_eq!(Side::ALL, [Side::Heads, Side::Tails]);
        assert_eq!(Side::from_wire("edge"), None);
    }

    #[test]
    fn serde_speaks_the_wire_name_and_refuses_others_as_serde_does() {
        assert_eq!(
            serde_json::to_string(&Coin::Nickel).ok().as_deref(),
            Some("\"nickel\"")
        );
        assert_eq!(
            serde_json::from_str::<Coin>("\"penny\"").ok(),
            Some(Coin::Penny)
        );
        let err = serde_json::from_str::<Side>("\"edge\"")
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some("unknown variant `edge`, expected `heads` or `tails` at line 1 column 6")
        );
        assert!(serde_json::from_str::<Side>("3").is_err());
    }
}
