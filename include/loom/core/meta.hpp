// Small type-level tools. Lists stay flat (one pack) and are indexed through
// std::tuple_element, so long networks do not instantiate deep recursions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>

namespace loom {

template <class... Ts>
struct TypeList {
  static constexpr std::size_t size = sizeof...(Ts);
};

template <class T>
inline constexpr bool dependent_false = false;

namespace detail {

template <std::size_t I, class List>
struct type_at;
template <std::size_t I, class... Ts>
struct type_at<I, TypeList<Ts...>> {
  using type = std::tuple_element_t<I, std::tuple<Ts...>>;
};

}  // namespace detail

template <std::size_t I, class List>
using type_at_t = typename detail::type_at<I, List>::type;

// Calls f(std::integral_constant<std::size_t, I>{}) for I = 0 .. N-1 in order.
template <std::size_t N, class F>
constexpr void static_for(F&& f) {
  const auto each = [&]<std::size_t... I>(std::index_sequence<I...>) {
    (f(std::integral_constant<std::size_t, I>{}), ...);
  };
  each(std::make_index_sequence<N>{});
}

// The same in reverse order, for backward passes.
template <std::size_t N, class F>
constexpr void static_for_reverse(F&& f) {
  const auto each = [&]<std::size_t... I>(std::index_sequence<I...>) {
    (f(std::integral_constant<std::size_t, N - 1 - I>{}), ...);
  };
  each(std::make_index_sequence<N>{});
}

namespace detail {

// __PRETTY_FUNCTION__ names T: the same string in every rank built from
// the same source, whatever the process.
template <class T>
constexpr std::string_view type_name() {
  return __PRETTY_FUNCTION__;
}

// 64-bit FNV-1a of bytes, chained through `hash`: digests that every rank
// and every file reader computes alike (program identity, checkpoint and
// data fingerprints).
inline constexpr std::uint64_t fnv1a_basis = 1469598103934665603ull;
inline std::uint64_t fnv1a(const void* data, std::size_t bytes, std::uint64_t hash = fnv1a_basis) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) hash = (hash ^ p[i]) * 1099511628211ull;
  return hash;
}
inline std::uint64_t fnv1a(std::string_view text, std::uint64_t hash = fnv1a_basis) {
  return fnv1a(text.data(), text.size(), hash);
}

// The type's name as the compiler spells it ("loom::Sequential<...>"), from
// type_name's __PRETTY_FUNCTION__ text, for messages.
template <class T>
std::string type_label() {
  const std::string_view text = type_name<T>();
  const auto begin = text.find("T = ");
  if (begin == std::string_view::npos) return std::string(text);
  const auto end = text.find_first_of(";]", begin);
  return std::string(text.substr(begin + 4, end - begin - 4));
}

}  // namespace detail
}  // namespace loom
