"""Twenty pydantic models for chat.completions.parse() (issue 25's test set): nested objects,
enums, arrays, optional fields. Every string and array is bounded, so a reply always fits
max_tokens: the grammar keeps a reply valid, not short, and a 135M model may fill a string
with emoji at four tokens a character."""

from __future__ import annotations

import enum
from typing import Annotated, Literal

from pydantic import BaseModel, Field

Name = Field(max_length=24)
Item = Annotated[str, Field(max_length=16)]


class Colour(enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Address(BaseModel):
    street: str = Field(max_length=30)
    city: str = Field(max_length=20)


class Person(BaseModel):
    name: str = Name
    age: int = Field(ge=0, le=120)


class WithAddress(BaseModel):
    name: str = Name
    address: Address


class Weather(BaseModel):
    city: str = Name
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=14)


class Favourite(BaseModel):
    colour: Colour
    reason: str = Field(max_length=40)


class Tags(BaseModel):
    tags: list[Item] = Field(max_length=3)


class Scores(BaseModel):
    scores: list[int] = Field(max_length=4)


class MaybeEmail(BaseModel):
    name: str = Name
    email: str | None = Field(max_length=30)


class Book(BaseModel):
    title: str = Field(max_length=30)
    author: Person
    year: int = Field(ge=1000, le=2030)


class Team(BaseModel):
    team: str = Name
    members: list[Person] = Field(max_length=2)


class Flag(BaseModel):
    answer: bool


class Point(BaseModel):
    x: float
    y: float


class Line(BaseModel):
    start: Point
    end: Point


class Priority(BaseModel):
    task: str = Field(max_length=30)
    level: Literal["low", "medium", "high"]


class Recipe(BaseModel):
    dish: str = Name
    ingredients: list[Item] = Field(max_length=3)
    minutes: int = Field(ge=1, le=300)


class Optional2(BaseModel):
    title: str = Name
    subtitle: str | None = Field(max_length=20)
    pages: int | None = Field(ge=1, le=999)


class Event(BaseModel):
    name: str = Name
    day: Literal["monday", "tuesday", "wednesday", "thursday", "friday"]
    online: bool


class Nested3(BaseModel):
    class Inner(BaseModel):
        class Core(BaseModel):
            value: int = Field(ge=0, le=9)

        core: Core

    inner: Inner


class Palette(BaseModel):
    colours: list[Colour] = Field(max_length=3)


class Translation(BaseModel):
    english: str = Field(max_length=20)
    french: str = Field(max_length=20)


MODELS = [
    (Person, "Describe a person called Ada who is 36."),
    (WithAddress, "Give the name and address of a person living in Paris."),
    (Weather, "Weather in Paris this week?"),
    (Favourite, "What is your favourite colour and why?"),
    (Tags, "Give up to three tags for a blog post about cooking."),
    (Scores, "Give four test scores between 0 and 100."),
    (MaybeEmail, "Describe Bob, who has no email address."),
    (Book, "Describe a famous novel and its author."),
    (Team, "Describe a team of two people."),
    (Flag, "Is water wet?"),
    (Point, "Give a point in the plane."),
    (Line, "Give a line segment from the origin to (3, 4)."),
    (Priority, "Describe an urgent task."),
    (Recipe, "Describe a quick recipe."),
    (Optional2, "Describe a short book."),
    (Event, "Describe a meeting on Tuesday."),
    (Nested3, "Give a digit, nested three levels deep."),
    (Palette, "Give a palette of two colours."),
    (Translation, "Translate 'hello' into French."),
    (Favourite, "Pick a colour for a stop sign, and say why."),
]


# a tool for the tool-call tests (tests/integration/test_sampling_*.py): bounded arguments
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
