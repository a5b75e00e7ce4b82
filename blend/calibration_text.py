"""Plain prose for calibrating the key shift (see blend/key_shift.py): original paragraphs written for this
project, on unrelated topics, each long enough to be a reusable chunk. Nothing here is a benchmark case."""

PARAGRAPHS = (
    "The old railway station at the edge of town closed in the spring of 1962, after the line to the coast was "
    "cut back. For almost twenty years the building stood empty, its clock stopped at a quarter past four and its "
    "platforms slowly disappearing under grass. A group of retired engineers bought it for a symbolic sum in 1981 "
    "and spent every weekend of the following decade repairing the roof, rebuilding the signal box and restoring "
    "two steam locomotives they had found rusting in a scrapyard. Today the station runs a short heritage service "
    "on summer Sundays, and its waiting room holds a small museum of tickets, lamps and timetables donated by "
    "families whose grandparents once worked on the line.",
    "Bread dough rises because yeast feeds on the sugars released from flour and gives off carbon dioxide, which "
    "the stretched gluten network traps in countless small bubbles. Temperature matters more than most home bakers "
    "expect: a dough kept at twenty degrees may need twice as long as one kept at twenty-six, and a long, cool rise "
    "develops a deeper flavour because the yeast and bacteria have time to produce acids and aromatic compounds. "
    "Salt slows fermentation and tightens the gluten, so it is usually added after the flour and water have rested "
    "together for half an hour. A well-risen loaf sounds hollow when tapped on the bottom and should cool fully "
    "before it is sliced.",
    "The river delta changes shape every year. During the rainy season the water carries millions of tonnes of silt "
    "down from the mountains, and where the current slows near the sea the silt settles into new banks and islands. "
    "Farmers plant rice on the fresh land as soon as it is firm enough to walk on, while fishermen follow the channels "
    "that open and close with each flood. Scientists who study the delta use satellite images to track how the "
    "coastline moves, and they have found that dams built upstream in the last fifty years now hold back much of the "
    "sediment, so parts of the shore are shrinking for the first time in recorded history.",
    "When the city council debated the new cycling lanes, the meeting lasted until after midnight. Shop owners on the "
    "main street worried that removing parking spaces would drive customers away, while parents spoke about children "
    "who were afraid to ride to school in traffic. An engineer from the transport department presented counts from "
    "other towns showing that trade usually recovered within a year and that accidents fell sharply. In the end the "
    "council approved a trial on two streets, with a promise to publish monthly figures on traffic, sales and "
    "injuries, and to return to the question once twelve months of data had been collected.",
    "A violin is built from more than seventy separate pieces of wood, most of them spruce and maple that have been "
    "dried for years before the maker begins. The top plate is carved by hand until it is only a few millimetres "
    "thick, and the maker taps it repeatedly, listening to how it rings, because small differences in thickness "
    "change the tone of the finished instrument. The varnish, applied in many thin coats, protects the wood but also "
    "affects how freely it vibrates. Players often say that a new violin needs several years of regular playing "
    "before its sound fully opens, although careful listening tests have had trouble confirming the claim.",
    "The hospital introduced a simple checklist for surgical teams three years ago. Before the first incision, the "
    "surgeon, the anaesthetist and the nurses stop for one minute, confirm the patient's name and the planned "
    "procedure, and say aloud any concerns about blood loss, allergies or equipment. Some senior doctors resisted at "
    "first, calling it a waste of time, but the rate of serious complications fell by almost a third in the first "
    "year. Staff surveys suggest that the biggest change was not the list itself but the fact that junior team "
    "members now feel able to speak up when something looks wrong.",
    "The small island has no airport, so most visitors arrive on the morning ferry, which takes about three hours "
    "from the mainland and is often cancelled in winter storms. There is one village with a harbour, a school, two "
    "shops and a church whose bell was cast from the metal of a wrecked cargo ship. Sheep outnumber people by about "
    "twenty to one. In recent years a handful of young families have moved back from the cities, attracted by faster "
    "internet connections that let them work remotely, and the school, which had fallen to four pupils, now has "
    "eleven and a second teacher.",
    "Modern weather forecasts are produced by computer models that divide the atmosphere into a three-dimensional "
    "grid and calculate how temperature, pressure, wind and moisture change in each cell over short time steps. "
    "Because small errors in the starting conditions grow quickly, forecasters run the same model dozens of times "
    "with slightly different starting values and look at how much the results spread. When the runs agree, the "
    "forecast can be trusted several days ahead; when they diverge, even tomorrow's rain is uncertain. Observations "
    "from balloons, ships, aircraft and satellites are fed into the models every few hours to keep them close to "
    "reality.",
    "The company's first product was a bicycle lamp designed in a garage by two students who were tired of batteries "
    "running out on dark evenings. Their lamp used a small generator in the wheel hub and a capacitor that kept the "
    "light on for several minutes after the rider stopped at a junction. They sold the first hundred units at a "
    "local market, reinvested every penny, and within five years employed forty people. Growth brought new problems: "
    "a large order from a retail chain nearly bankrupted them when the chain paid four months late, and they learned "
    "to keep enough cash in reserve to survive such delays.",
    "Honey bees communicate the location of food through a movement known as the waggle dance. A forager returning "
    "to the hive walks in a figure-of-eight pattern on the vertical surface of the comb, shaking her body during the "
    "straight middle run. The angle of that run relative to straight up tells the other bees the direction of the "
    "flowers relative to the sun, and the length of the run indicates the distance. Other workers follow the dancer, "
    "smell the nectar she carries, and then fly out to search. Researchers have shown that bees adjust the angle "
    "through the day to account for the movement of the sun.",
    "Under the new contract law, a consumer who buys goods online has fourteen days to cancel the purchase without "
    "giving any reason. The period begins on the day the goods are delivered rather than the day of the order, and "
    "the seller must refund the full price, including the standard delivery cost, within fourteen days of being "
    "told about the cancellation. The buyer usually pays for returning the goods unless the seller has agreed "
    "otherwise. Certain items are excluded, such as perishable food, sealed hygiene products that have been opened, "
    "and goods made to the customer's own specifications.",
    "The football club had not won a trophy for thirty-one years when a new coach arrived from the second division "
    "with little money to spend. Instead of buying famous players, he promoted five teenagers from the youth team and "
    "insisted that every player, whatever his position, practise passing for an hour each morning. The first season "
    "was difficult and the club finished in the middle of the table, but supporters noticed a calmer, more patient "
    "style of play. In the second season the team lost only four matches, and on the last day a crowd of forty "
    "thousand watched the captain lift the cup.",
)
