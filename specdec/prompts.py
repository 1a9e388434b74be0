"""The project's own prompt set, and loading/encoding of prompt files.

``builtin_prompts()`` returns 48 prompts written for this project, eight of each kind in
``KINDS``: multi-turn chat, translation, summarisation (of passages written here, from a
few sentences to about 400 words), question answering, math word problems, and
retrieval-augmented answering (one to three short documents, then a question). Their
lengths range from a handful of words to several hundred. The list interleaves the kinds
(chat, translation, summarization, qa, math, rag, chat, ...), so any prefix of eight or
more prompts covers all six kinds and a mix of lengths. The English is deliberately plain:
the default target is a 135M-parameter instruct model. ``long_prompts()`` joins them
into prompts past a 512-token sliding window (kind ``"long"``).

``load_jsonl(path)`` reads a prompt file in either of two line formats:

- SpecBench questions: ``{"question_id": 81, "category": "writing", "turns": ["...", ...]}``;
  only the first turn is used, and the category becomes the prompt's kind;
- plain prompts: ``{"prompt": "...", "id": "optional"}``, of kind ``"custom"``.

``encode(prompts, tokenizer)`` turns prompts into token-id lists through the tokenizer's
chat template (with the generation prompt appended), or, for a tokenizer without one,
through plain text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

KINDS = ("chat", "translation", "summarization", "qa", "math", "rag")

JSONL_RULE = ("each line must be a JSON object with 'turns' (a non-empty list of strings) "
              "or 'prompt' (a string)")


@dataclass(frozen=True)
class Prompt:
    """One prompt: chat-template messages (role "user"/"assistant"), ending on a user turn."""

    id: str
    kind: str
    messages: tuple[dict, ...]

    @property
    def text(self) -> str:
        """All message contents, separated by blank lines."""
        return "\n\n".join(m["content"] for m in self.messages)

    def word_count(self) -> int:
        """Whitespace-separated words over all messages."""
        return sum(len(m["content"].split()) for m in self.messages)


def _user(text: str) -> tuple[dict, ...]:
    return ({"role": "user", "content": text},)


def _turns(*texts: str) -> tuple[dict, ...]:
    """Alternating user/assistant messages, starting (and, for odd counts, ending) on user."""
    roles = ("user", "assistant")
    return tuple({"role": roles[i % 2], "content": t} for i, t in enumerate(texts))


def _docs(question: str, *documents: str) -> str:
    parts = ["Answer the question using only the documents below."]
    parts += [f"Document {i}:\n{d}" for i, d in enumerate(documents, 1)]
    parts.append(f"Question: {question}")
    return "\n\n".join(parts)


# --------------------------------------------------------------------------- chat

_CHAT = [
    _turns(
        "Hi! Can you help me plan a small vegetable garden?",
        "Of course. How much space do you have, and how many hours of sun does it get each day?",
        "It is about two metres by three metres, and it gets sun for most of the afternoon. "
        "What should I plant first?",
    ),
    _turns(
        "What is a noun?",
        "A noun is a word that names a person, place, thing or idea, such as teacher, city or book.",
        "Give me three more examples.",
    ),
    _turns(
        "I am learning Python. What is a list?",
        "A list is an ordered collection of items written inside square brackets, for example "
        "[1, 2, 3]. You can add, remove and change the items in a list.",
        "How do I add an item to the end of a list?",
        "Use the append method. If numbers = [1, 2, 3], then numbers.append(4) changes the list "
        "to [1, 2, 3, 4].",
        "And how do I remove the first item?",
    ),
    _turns(
        "I am going on a four-day hiking trip in the mountains next month. I have never done a "
        "trip this long before. What are the most important things to pack?",
        "Good questions to start with are: will you sleep in huts or in a tent, and what weather "
        "is expected? In general you will need sturdy boots that are already broken in, layers of "
        "warm clothing, a waterproof jacket, a map, a first aid kit, enough water or a way to "
        "clean water, and food that is light but gives plenty of energy.",
        "We will sleep in mountain huts, so I do not need a tent. The forecast says cool nights "
        "and some rain. How heavy should my backpack be?",
        "Without a tent, sleeping bag or cooking gear, many hikers aim for a pack of about six to "
        "eight kilograms plus water. A common rule of thumb is to keep the loaded pack below "
        "about a fifth of your body weight.",
        "That sounds manageable. Can you turn all of this into a short checklist I can print?",
    ),
    _turns(
        "How do I cook white rice on the stove?",
        "Rinse one cup of rice, put it in a pot with about one and a half to two cups of water "
        "and a pinch of salt, bring it to a boil, then cover it and cook on low heat for about "
        "fifteen to eighteen minutes.",
        "Mine always sticks to the bottom of the pot.",
        "That usually means the heat is too high or the rice cooked a little too long. Try the "
        "lowest heat setting, and do not lift the lid while it cooks.",
        "Should I let it rest after cooking?",
    ),
    _turns(
        "I have to give a five-minute talk about recycling to a class of ten-year-old children "
        "next week. Their teacher asked me because I work at the local recycling centre. I know "
        "the topic well, but I have never spoken to children before, and I am worried that I "
        "will either use words that are too difficult or that they will get bored. The class "
        "has about twenty-five students. The teacher said I can bring objects to show them, and "
        "there is a projector if I want to use slides. I would like the children to remember "
        "at least two or three simple facts when they go home.",
        "That sounds like a great opportunity. For ten-year-olds, objects they can touch and "
        "simple questions usually work better than slides full of text. You could bring a clean "
        "plastic bottle, a tin can, a newspaper and a glass jar, and ask the class which bin "
        "each one goes in. Then show what each material can become after it is recycled. "
        "Which facts would you most like them to remember?",
        "I would like them to remember that recycling saves materials and energy, that items "
        "must be clean and sorted, and that some things, like greasy pizza boxes, cannot be "
        "recycled. I also like your idea about the objects. Could you suggest how I should "
        "split the five minutes, with a rough plan for each part?",
    ),
    _turns(
        "How many hours of sleep does an adult need?",
        "Most health organisations recommend that adults get at least seven hours of sleep per "
        "night, and many people feel best with seven to nine hours.",
        "I often wake up tired even after eight hours. What simple habits could help?",
    ),
    _turns(
        "The heater in my rented flat stopped working three days ago. I want to write to my "
        "landlord. Can you help?",
        "Yes. A short, polite email works best. It should say what the problem is, when it "
        "started, and what you would like the landlord to do, for example to send a repair "
        "person by a certain date.",
        "Good. The landlord's name is Mr. Brown. The heater makes a clicking sound but gives no "
        "heat. I am at home on weekday evenings and all day Saturday.",
        "Thanks. Would you like the email to be formal, or friendly but polite?",
        "Friendly but polite, please. Write the full email for me.",
    ),
]

# ---------------------------------------------------------------- translation

_TRANSLATION = [
    _user("Translate into French: Good morning, how are you?"),
    _user("Translate the following sentence into Spanish: The library opens at nine in the "
          "morning and closes at six in the evening."),
    _user("Translate this short weather report into German:\n\n"
          "Tomorrow will start cloudy, with light rain in the north during the morning. In the "
          "afternoon the sky will clear and temperatures will reach eighteen degrees. The "
          "evening will be dry and calm."),
    _user("Translate into English: Mi hermano vive en una casa pequeña cerca del río. Todos "
          "los sábados vamos juntos al mercado para comprar fruta y pan."),
    _user("Please translate the following notice for hotel guests into Italian. Keep the tone "
          "polite and keep the times as they are.\n\n"
          "Dear guests, breakfast is served in the dining room on the ground floor every day "
          "from 7:00 to 10:00. On Sundays breakfast is served until 10:30. If you would like "
          "breakfast in your room, please call the reception desk before 21:00 on the evening "
          "before. The swimming pool is open from 8:00 to 20:00, and towels are available next "
          "to the pool. Please remember that children under twelve must be with an adult in "
          "the pool area. We wish you a pleasant stay."),
    _user("Translate into English: Le train pour Lyon part à quinze heures. N'oubliez pas "
          "votre billet."),
    _user("Translate these washing machine instructions into Portuguese. Use short, clear "
          "sentences.\n\n"
          "1. Sort your clothes by colour and by fabric.\n"
          "2. Open the door and put the clothes into the drum. Do not fill the drum more than "
          "three quarters full.\n"
          "3. Add detergent to the small drawer at the top of the machine.\n"
          "4. Close the door until you hear a click.\n"
          "5. Turn the dial to choose a programme. Use 30 degrees for most coloured clothes.\n"
          "6. Press the start button. The screen shows how many minutes are left.\n"
          "7. When the programme ends, wait two minutes before opening the door."),
    _user("Translate the following letter into French. Keep the paragraph breaks.\n\n"
          "Dear Anna,\n\n"
          "Thank you very much for your letter and for the photographs of your new garden. The "
          "flowers look beautiful, and I can see that you have worked hard on it since the "
          "spring. I especially liked the picture of the small apple tree next to the fence.\n\n"
          "Our news is simple. The children started at their new school in September, and "
          "they both like it. Leo has joined the football team, and Mia is learning to play "
          "the violin. She practises every evening, so the house is never quiet. My work at "
          "the hospital is busy, but I have more free weekends than last year, which is "
          "good.\n\n"
          "We would love to visit you in the summer. Would the second or third week of July "
          "be convenient for you? We plan to travel by train, and we could stay for four or "
          "five days. If those weeks are difficult, please tell me and we will find another "
          "date.\n\n"
          "Please say hello to your parents from all of us. I hope your mother's knee is "
          "feeling better now.\n\n"
          "With love,\n"
          "Clara"),
]

# -------------------------------------------------------------- summarization

_BEES = (
    "Honeybees live in colonies that can contain tens of thousands of bees during the "
    "summer. Each colony has one queen, whose main job is to lay eggs; in spring a healthy "
    "queen can lay more than a thousand eggs in a single day. Most of the other bees are "
    "female workers. Workers do almost every task in the hive, and the job a worker does "
    "changes as she gets older. Young workers clean the cells and feed the larvae. Older "
    "workers build wax comb, store food and guard the entrance. The oldest workers fly out "
    "to collect nectar, pollen and water. Male bees, called drones, do not collect food; "
    "their role is to mate with queens from other colonies.\n\n"
    "Foragers share information about good patches of flowers through a movement known as "
    "the waggle dance. A forager returning to the hive walks in a figure-eight pattern on "
    "the comb and shakes her body during the straight part of each run. The direction of "
    "the straight run shows the direction of the food compared with the position of the "
    "sun, and the length of the run shows how far away the food is. Other workers follow "
    "the dancer and then fly out to find the same flowers.\n\n"
    "Honeybees turn nectar into honey by adding enzymes to it and by fanning their wings "
    "to evaporate water until the honey is thick. The honey is stored in wax cells and "
    "sealed with a thin wax cap. This store of food lets the colony survive the winter, "
    "when there are no flowers. In cold weather the bees gather in a tight cluster and "
    "shiver their flight muscles to make heat, which keeps the centre of the cluster "
    "warm.\n\n"
    "Honeybees are also important pollinators. As they move from flower to flower, pollen "
    "sticks to their hairy bodies and is carried to other plants. This helps many crops, "
    "such as apples, almonds and cucumbers, to produce fruit and seeds."
)

_LIBRARY_NOTICE = (
    "The Central Library on Market Street will close for building work from 1 March to 30 "
    "April. During this time, books can be returned at the Park Road branch, which will "
    "open one hour later in the evening than usual. Online services, including e-books and "
    "the catalogue, will not be affected. The library expects to reopen on 2 May with a "
    "larger children's area and new study rooms."
)

_WATER_CYCLE = (
    "The water cycle describes how water moves around the Earth. Heat from the sun warms "
    "water in oceans, lakes and rivers, and some of it evaporates, turning into water "
    "vapour that rises into the air. Plants also release water vapour through their "
    "leaves. As the warm, moist air rises, it cools. Cooler air cannot hold as much "
    "vapour, so the vapour condenses into tiny droplets of water or crystals of ice, which "
    "form clouds. When the droplets join together and become heavy enough, they fall back "
    "to the ground as rain, snow or hail. This is called precipitation. Some of the water "
    "flows over the land into streams and rivers and finally back to the sea. Some soaks "
    "into the ground and becomes groundwater, which can stay underground for a long time "
    "before it reaches a river or a spring. Water that falls as snow in cold places may be "
    "stored in glaciers for many years. Because of this cycle, the same water is used again "
    "and again, and the total amount of water on Earth stays almost the same."
)

_MEETING_EMAIL = (
    "Hi everyone, a quick update about next week. The project meeting planned for Tuesday "
    "at 10:00 is moved to Thursday at 14:00, because the meeting room is being painted on "
    "Tuesday. The meeting will be in room 3B on the second floor. Please bring your progress "
    "notes, and send me any topics you want to add to the agenda by Wednesday at noon. "
    "Coffee will be provided. Thanks, Sam"
)

_BICYCLE = (
    "The bicycle developed over many decades. One of the earliest machines was built in "
    "Germany in 1817 by Karl Drais. It had two wheels in a line and a seat, but no pedals: "
    "the rider pushed along the ground with their feet, a little like a child on a balance "
    "bike today. These running machines were popular for a short time, but they were heavy "
    "and only useful on smooth roads.\n\n"
    "In the 1860s, inventors in France added pedals directly to the front wheel. These "
    "machines, often called velocipedes, had wooden wheels with iron rims, and on the rough "
    "streets of the time they gave such an uncomfortable ride that in England they were "
    "nicknamed boneshakers. Because the pedals turned the front wheel directly, one turn of "
    "the pedals moved the bicycle only as far as one turn of that wheel.\n\n"
    "To go faster, makers in the 1870s built bicycles with a very large front wheel and a "
    "small rear wheel. These high-wheelers, later known in Britain as penny-farthings, "
    "were fast and became popular with young men who enjoyed racing. However, the rider sat "
    "high above the ground, and if the front wheel hit a stone the rider could be thrown "
    "forward over the handlebars. Many people found them too dangerous to ride.\n\n"
    "The answer was the safety bicycle, which appeared in the 1880s. It had two wheels of "
    "similar size, and the pedals turned the rear wheel through a chain. Gears on the chain "
    "meant that the wheels could be small while the bicycle was still fast. A few years "
    "later, air-filled rubber tyres made the ride much smoother. The basic shape of the "
    "safety bicycle is still used by most bicycles today.\n\n"
    "The safety bicycle led to a cycling boom in the 1890s. For the first time, many "
    "ordinary people could travel long distances cheaply and on their own schedule. "
    "Cycling gave many women a new freedom to travel without help, and it even influenced "
    "fashion, as clothing became more practical for riding. Cycling clubs also campaigned "
    "for better roads, which later helped motorists as well."
)

_PHOTOSYNTHESIS = (
    "Photosynthesis is the process that green plants use to make their own food. It takes "
    "place mainly in the leaves, inside small structures called chloroplasts. Chloroplasts "
    "contain a green substance called chlorophyll, which absorbs energy from sunlight. The "
    "plant takes in carbon dioxide from the air through tiny openings in its leaves, and it "
    "takes in water from the soil through its roots. Using the energy from light, the plant "
    "turns the carbon dioxide and water into glucose, a type of sugar, and releases oxygen "
    "into the air as a by-product. The plant uses the glucose for energy and to build new "
    "material such as stems, leaves and roots. Photosynthesis is important for almost all "
    "life on Earth, because it produces the oxygen that animals breathe, and because plants "
    "are at the start of most food chains."
)

_KETTLE_REVIEW = (
    "I bought this kettle two months ago. It boils water quickly and it is quiet, which I "
    "like. The handle stays cool and the water window is easy to read. My only complaint is "
    "that the lid is a bit stiff to open with one hand. Overall I am happy with it and would "
    "buy it again."
)

_MOON = (
    "The Moon does not make its own light. We see it because it reflects light from the "
    "sun. At any time, the half of the Moon that faces the sun is lit, and the other half "
    "is dark. As the Moon travels around the Earth, we see different amounts of its lit "
    "half, and this is why its shape seems to change during the month. These shapes are "
    "called phases.\n\n"
    "At new moon, the Moon is between the Earth and the sun, and its lit side faces away "
    "from us, so we can hardly see it. Over the next days a thin curve of light appears, "
    "called a waxing crescent. About a week after new moon, we see half of the disc lit; "
    "this is the first quarter. The lit part keeps growing through the waxing gibbous "
    "phase until, about two weeks after new moon, the whole face is bright. This is full "
    "moon, when the Earth is roughly between the sun and the Moon. After full moon the lit "
    "part shrinks again, through the waning gibbous phase, the last quarter and the waning "
    "crescent, until the next new moon. The full cycle of phases takes about 29.5 days.\n\n"
    "The Moon always shows the same side to the Earth, because it turns once on its axis "
    "in the same time it takes to go around the Earth once. People sometimes ask why there "
    "is not an eclipse every month. The reason is that the Moon's orbit is tilted by about "
    "five degrees compared with the Earth's path around the sun, so in most months the "
    "Moon passes a little above or below the line between the sun and the Earth."
)

_SUMMARIZATION = [
    _user("Summarize the following passage in three sentences.\n\n" + _BEES),
    _user("Summarize this notice in one sentence.\n\n" + _LIBRARY_NOTICE),
    _user("Write a short summary of the following text for a school student.\n\n"
          + _WATER_CYCLE),
    _user("Summarize this email in two bullet points.\n\n" + _MEETING_EMAIL),
    _user("Read the passage below and summarize the main stages in the history of the "
          "bicycle in one short paragraph.\n\n" + _BICYCLE),
    _user("Summarize the following paragraph in two sentences.\n\n" + _PHOTOSYNTHESIS),
    _user("Summarize this customer review in one sentence.\n\n" + _KETTLE_REVIEW),
    _user("Summarize the passage below in about four sentences, using simple words.\n\n"
          + _MOON),
]

# ------------------------------------------------------------------------- qa

_QA = [
    _user("What is the capital of Japan?"),
    _user("Why is the sky blue?"),
    _user("How many legs does a spider have?"),
    _user("What is the difference between weather and climate? Please answer in two or three "
          "sentences."),
    _user("Who wrote the play Romeo and Juliet?"),
    _user("What is a leap year, and why do we have them?"),
    _user("I keep a small aquarium with a few goldfish on a shelf next to a sunny window. "
          "Over the last few weeks the water has slowly turned green, even though I change "
          "part of the water every week and I do not give the fish very much food. The fish "
          "seem healthy and active. What is most likely causing the green water, and what "
          "simple changes could I make to stop it from happening again?"),
    _user("What are the three common states of matter? Give one example of each."),
]

# ----------------------------------------------------------------------- math

_MATH = [
    _user("A baker made 24 muffins and sold 17. How many muffins are left?"),
    _user("Tom has 3 boxes with 12 pencils in each box. He gives 8 pencils to his sister. How "
          "many pencils does Tom have now? Show your steps."),
    _user("A train travels at a steady speed of 80 kilometres per hour. How far does it travel "
          "in 2 hours and 30 minutes?"),
    _user("A jacket costs $60. It is on sale for 25% off. What is the sale price? Explain your "
          "answer step by step."),
    _user("A rectangular garden is 12 metres long and 7 metres wide. What is its area? The "
          "owner wants to put a fence around the whole garden. How many metres of fence are "
          "needed?"),
    _user("A class of 28 students and 4 teachers is going on a trip to a science museum. The "
          "bus costs $350 for the day. Museum tickets cost $12 for each student and $15 for "
          "each teacher. Each student also gets a packed lunch that costs $6, while the "
          "teachers bring their own lunch. The school has already collected $20 from each "
          "student. How much more money is needed to pay for the whole trip? Show each step "
          "of your calculation."),
    _user("Maria's scores on her first four tests were 78, 85, 90 and 83. What score does she "
          "need on the fifth test so that her average over all five tests is exactly 85?"),
    _user("Read the story and answer the question at the end. Work through the days one at "
          "a time and show your working.\n\n"
          "Mrs. Lee owns a small bookshop that also sells school supplies. On Monday morning "
          "she counts 120 notebooks on the shelves. On Monday she sells 18 notebooks. On "
          "Tuesday the shop is busier, and she sells twice as many notebooks as on Monday. "
          "On Wednesday morning, before the shop opens, a delivery of 60 new notebooks "
          "arrives, and she puts all of them on the shelves. During Wednesday she sells 25 "
          "notebooks. On Thursday she sells half as many notebooks as she sold on Tuesday. "
          "On Friday a teacher from the nearby school buys 3 packs of 10 notebooks each for "
          "her class, and other customers buy 7 more notebooks. The shop is closed at the "
          "weekend, and no notebooks are lost or damaged during the week.\n\n"
          "Mrs. Lee wants to start next Monday with at least 50 notebooks on the shelves. How "
          "many notebooks are left at the end of Friday, and what is the smallest number of "
          "notebooks she must order to have at least 50 on Monday morning?"),
]

# ------------------------------------------------------------------------ rag

_RAG = [
    _user(_docs(
        "Can I borrow a DVD on a Sunday, and how long can I keep it?",
        "Greenfield Public Library opening hours: Monday to Friday, 9:00 to 19:00. Saturday, "
        "10:00 to 17:00. Sunday, 12:00 to 16:00. The library is closed on public holidays.",
        "Borrowing rules: Members can borrow up to ten items at a time. Books can be kept "
        "for three weeks and can be renewed twice. DVDs and video games can be kept for one "
        "week and cannot be renewed. All items can be borrowed on any day the library is "
        "open.",
    )),
    _user(_docs(
        "How long does the battery last on the highest brightness level?",
        "The Lumo T2 desk lamp has three brightness levels and charges through a USB-C cable. "
        "A full charge takes about three hours. On the lowest level the battery lasts about "
        "twelve hours, on the middle level about seven hours, and on the highest level about "
        "four hours.",
    )),
    _user(_docs(
        "I am a new member and I want a small plot. How much will I pay in my first year, "
        "and am I allowed to use a hose to water my plants in July?",
        "Riverside Community Garden: membership. The garden is open to anyone who lives in "
        "the town. New members pay a one-time joining fee of 15 euros, which covers a key "
        "to the main gate and a short introduction to the garden rules. Members must attend "
        "at least two shared work days each year, when everyone helps to clear paths, cut "
        "hedges and repair the fences. Members who cannot come to a work day can instead pay "
        "10 euros for each missed day.",
        "Riverside Community Garden: plots and yearly fees. There are two sizes of plot. A "
        "small plot measures 3 by 5 metres and costs 30 euros per year. A large plot "
        "measures 6 by 5 metres and costs 50 euros per year. Yearly fees are paid in March. "
        "Members who join later in the year still pay the full yearly fee. Each member may "
        "rent only one plot at a time, but families may share a large plot.",
        "Riverside Community Garden: water and tools. Water is taken from the rain tanks "
        "next to the tool shed. From June to August, hoses are not allowed, and members must "
        "use watering cans so that the tanks do not run empty. In the other months, hoses "
        "may be used for up to thirty minutes a day. The tool shed contains spades, rakes, "
        "wheelbarrows and watering cans that all members may use. Tools must be cleaned and "
        "returned to the shed on the same day. Please report broken tools to the garden "
        "committee.",
    )),
    _user(_docs(
        "I arrive at Hill Street station at 10:15. When is the next train to Riverside?",
        "Weekday timetable, Hill Street to Riverside: trains leave at 7:40, 8:10, 8:40, 9:25, "
        "10:05, 10:35, 11:35 and then every hour until 18:35. The journey takes 22 minutes.",
        "Service notice: the 10:35 train from Hill Street to Riverside does not run on "
        "weekdays during May because of work on the line. All other trains run as normal.",
    )),
    _user(_docs(
        "In which country is Mount Kilimanjaro, and how tall is it?",
        "Mount Kilimanjaro is a large dormant volcano in Tanzania, in East Africa. It has "
        "three volcanic cones, called Kibo, Mawenzi and Shira. Its highest point, Uhuru "
        "Peak on Kibo, is about 5,895 metres above sea level, which makes Kilimanjaro the "
        "highest mountain in Africa.",
    )),
    _user(_docs(
        "How many days of paid holiday does an employee have after working at the company "
        "for six years?",
        "Holiday policy, section 1: All full-time employees receive 25 days of paid holiday "
        "per calendar year, in addition to public holidays. Part-time employees receive "
        "holiday in proportion to the hours they work.",
        "Holiday policy, section 2: After five full years of work at the company, employees "
        "receive 2 extra days of paid holiday per year. After ten full years, they receive "
        "5 extra days per year instead of 2. Up to five unused days can be carried over to "
        "the next year.",
    )),
    _user(_docs(
        "How many moons does Mars have, what are they called, and which rover landed on "
        "Mars in 2012?",
        "Mars is the fourth planet from the sun. It is smaller than the Earth, with a "
        "diameter of about half of the Earth's. A day on Mars lasts about 24 hours and 37 "
        "minutes, a little longer than a day on Earth, but a year on Mars lasts about 687 "
        "Earth days. The planet looks red because its surface contains a lot of iron oxide, "
        "which is similar to rust. Mars has a very thin atmosphere made mostly of carbon "
        "dioxide, so it is much colder than the Earth.",
        "Mars has two small moons, named Phobos and Deimos. Both have irregular shapes, more "
        "like potatoes than balls. Phobos is the larger of the two and orbits very close to "
        "the planet, going around Mars about three times in one Martian day. Deimos is "
        "smaller and orbits further away. Many scientists think the two moons may be "
        "captured asteroids or pieces left over from a large impact, but this is still "
        "being studied.",
        "Several robotic rovers have explored the surface of Mars. Sojourner, a small rover "
        "about the size of a microwave oven, landed in 1997. The twin rovers Spirit and "
        "Opportunity landed in 2004, and Opportunity kept working for more than fourteen "
        "years. Curiosity, a rover about the size of a small car, landed in Gale Crater in "
        "2012 and studies rocks to learn whether Mars once had conditions suitable for "
        "life. Perseverance landed in 2021 and collects rock samples.",
    )),
    _user(_docs(
        "How much will two adults and two children, aged 8 and 15, pay to visit the museum "
        "on a Saturday?",
        "Harbour Town Museum ticket prices: Adults, 12 euros. Children aged 6 to 16, 5 "
        "euros. Children under 6, free. Students and seniors over 65, 8 euros. A family "
        "ticket for two adults and up to three children aged 6 to 16 costs 28 euros.",
        "Opening times: The museum is open Tuesday to Sunday from 10:00 to 17:00. Prices "
        "are the same on every day of the week. Entry is free for everyone on the first "
        "Sunday of each month.",
    )),
]

_BY_KIND = dict(zip(KINDS, (_CHAT, _TRANSLATION, _SUMMARIZATION, _QA, _MATH, _RAG)))


def builtin_prompts() -> list[Prompt]:
    """The 48 built-in prompts, kinds interleaved: chat-01, translation-01, ..., rag-01, chat-02, ..."""
    count = min(len(v) for v in _BY_KIND.values())
    return [
        Prompt(id=f"{kind}-{i + 1:02d}", kind=kind, messages=_BY_KIND[kind][i])
        for i in range(count)
        for kind in KINDS
    ]


def long_prompts(count: int = 8, min_words: int = 440, step_words: int = 22) -> list[Prompt]:
    """``count`` long single-turn prompts built from the built-in texts, for models with a
    sliding window (Gemma 3's is 512 tokens): prompt i is a run of notes, the built-in
    prompts from the (5 i)-th on, cut at ``min_words + i step_words`` words (Gemma 3's
    tokenizer makes about 1.3 tokens of a word: 550 to 780 tokens for the defaults), then
    one question about the first note. Lengths differ row to row (mixed padding in one
    batch) and all lie past the window."""
    base = builtin_prompts()
    out = []
    for i in range(count):
        want = min_words + i * step_words
        notes, words, j = [], 0, 5 * i
        while words < want:
            text = base[j % len(base)].text.split()[: want - words]
            notes.append(f"Note {len(notes) + 1}: " + " ".join(text))
            words += len(text)
            j += 1
        text = "\n\n".join(notes + ["Question: in one sentence, what is note 1 about?"])
        out.append(Prompt(id=f"long-{i + 1:02d}", kind="long", messages=_user(text)))
    return out


def prompt_set(name_or_path=None) -> list[Prompt]:
    """A prompt set by name or file: None or ``"builtin"`` -> ``builtin_prompts()``;
    ``"long"`` -> ``long_prompts()``; anything else is a JSONL file (``load_jsonl``)."""
    if name_or_path in (None, "builtin"):
        return builtin_prompts()
    if name_or_path == "long":
        return long_prompts()
    return load_jsonl(name_or_path)


def load_jsonl(path) -> list[Prompt]:
    """Prompts from a JSON-lines file (SpecBench questions or plain ``{"prompt": ...}`` lines).

    A SpecBench line gives a single-turn prompt from its first turn, with its category as
    the kind and its question_id as the id. A plain line gives a prompt of kind "custom",
    with its "id" if present (else ``line-N``). Blank lines are skipped; any other line
    that does not follow the format raises ValueError naming the file and line number.
    """
    path = Path(path)
    prompts = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg}); {JSONL_RULE}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: not a JSON object; {JSONL_RULE}")
            if "turns" in obj:
                turns = obj["turns"]
                if (not isinstance(turns, list) or not turns
                        or not all(isinstance(t, str) for t in turns)):
                    raise ValueError(f"{where}: bad 'turns'; {JSONL_RULE}")
                qid = obj.get("question_id")
                pid = str(qid) if qid is not None else f"line-{lineno}"
                kind = obj.get("category")
                kind = str(kind) if kind else "custom"
                prompts.append(Prompt(id=pid, kind=kind, messages=_user(turns[0])))
            elif "prompt" in obj:
                text = obj["prompt"]
                if not isinstance(text, str):
                    raise ValueError(f"{where}: bad 'prompt'; {JSONL_RULE}")
                pid = obj.get("id")
                pid = str(pid) if pid is not None else f"line-{lineno}"
                prompts.append(Prompt(id=pid, kind="custom", messages=_user(text)))
            else:
                raise ValueError(f"{where}: neither 'turns' nor 'prompt'; {JSONL_RULE}")
    return prompts


def _plain_text(messages) -> str:
    """A prompt as plain text, for tokenizers without a chat template."""
    if len(messages) == 1:
        return messages[0]["content"]
    label = {"user": "User", "assistant": "Assistant"}
    lines = [f"{label.get(m['role'], m['role'])}: {m['content']}" for m in messages]
    return "\n\n".join(lines) + "\n\nAssistant:"


def _as_ids(out) -> list[int]:
    if isinstance(out, Mapping) or hasattr(out, "keys"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    out = list(out)
    if out and isinstance(out[0], (list, tuple)):  # a batch of one
        if len(out) != 1:
            raise ValueError(f"expected one sequence of token ids, got a batch of {len(out)}")
        out = list(out[0])
    return [int(t) for t in out]


def encode(prompts, tokenizer) -> list[list[int]]:
    """Token ids of each prompt, ready for generation.

    With a chat template: ``apply_chat_template(messages, add_generation_prompt=True)``.
    Without one: the turns as plain text (a single turn as is; several as "User: ..." /
    "Assistant: ..." lines ending on "Assistant:"), tokenized with the special tokens the
    tokenizer adds by itself (Gemma's beginning-of-text token; none for SmolLM2's).
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    result = []
    for p in prompts:
        if has_template:
            out = tokenizer.apply_chat_template(list(p.messages), add_generation_prompt=True)
        else:
            out = tokenizer(_plain_text(p.messages))
        result.append(_as_ids(out))
    return result
